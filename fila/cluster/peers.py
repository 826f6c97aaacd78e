"""Calls from this node to the other nodes: one gRPC channel per node, and forwarding
with the caller's credentials.

A forwarded call carries the caller's own `authorization` (and W3C trace context),
so the owner authenticates and authorizes it exactly as if the caller had come to it
directly: nodes do not trust each other's checks. It also carries
`x-fila-forwarded-by: <node id>`, which makes the receiving node answer rather than
forward again (`fila.cluster.errors.NotOwner`): a call crosses at most one hop. (A
client could send that header itself; it only keeps its call from being forwarded.)

Requests and answers cross as bytes, so the hop costs a serialization at most, not a
re-encoding of the answer. The owner's failure comes back as it was (`RemoteError`:
code, message, error kind); a node that does not answer at all (connection refused,
reset, no route) is reported through `down`, as "queue q is on node 3, which is down".
So is a call in flight to a node that etcd then counts down (it stopped answering:
paused, cut off, crashed without a reset): its channel is closed at once, and the call
ends with `down` instead of waiting on the node, or forever when the caller gave no
deadline. gRPC ends the calls of a closed channel with a bare `asyncio.CancelledError`;
`cut_off` tells that one apart from a cancellation of the caller's own task (the
client went away, the server stops), which must go on as a cancellation.

Channels reconnect quickly (`fila.cluster.reconnect`) because a restarted owner should be
reachable as soon as it serves; a node that comes back at a new address or with a new
lease gets a fresh channel.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any, Final, TypeAlias, cast

import grpc
import grpc.aio

from fila.cluster.errors import RemoteError
from fila.cluster.layout import NodeRecord
from fila.cluster.reconnect import RECONNECT_BACKOFF
from fila.core.errors import BrokerError
from fila.wire import ERROR_KIND_METADATA_KEY

log = logging.getLogger("fila.cluster")

FORWARDED_BY: Final = "x-fila-forwarded-by"
# Request metadata a forwarded call carries over from the caller's.
PASSED_ON: Final = frozenset({"authorization", "traceparent", "tracestate"})

CHANNEL_OPTIONS: Final = (
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_send_message_length", -1),
    *RECONNECT_BACKOFF,
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Metadata: TypeAlias = tuple[tuple[str, str], ...]


def is_forwarded(context: Context) -> bool:
    received = cast(Iterable[tuple[str, str | bytes]], context.invocation_metadata() or ())
    return any(key == FORWARDED_BY for key, _ in received)


def _identity(raw: bytes) -> bytes:
    return raw


class Link:
    """The channel to one node as one record (address and lease) describes it; `cut`
    once that record is gone (the node left, or came back with a new lease)."""

    __slots__ = ("channel", "cut", "record")

    def __init__(self, record: NodeRecord, channel: grpc.aio.Channel) -> None:
        self.record = record
        self.channel = channel
        self.cut = False


def cut_off(link: Link) -> bool:
    """Whether the `asyncio.CancelledError` just caught by a call on `link` came from
    closing its channel (the node is gone: answer `down`), not from cancelling the
    running task (re-raise it)."""
    task = asyncio.current_task()
    return link.cut and (task is None or task.cancelling() == 0)


class Peers:
    def __init__(self, node_id: int, credentials: grpc.ChannelCredentials | None) -> None:
        self._node_id = str(node_id)
        self._credentials = credentials
        self._links: dict[int, Link] = {}
        self._current: dict[int, NodeRecord | None] = {}  # as the listener last heard
        self._closing: set[asyncio.Task[None]] = set()

    def node_changed(self, node_id: int, record: NodeRecord | None) -> None:
        """`fila.cluster.nodes` listener: the channel to a node that left or came back
        (new lease, maybe a new address) is cut at once, ending the calls in flight on
        it; the node gets a fresh channel on its next call."""
        self._current[node_id] = record
        known = self._links.get(node_id)
        if known is not None and known.record != record:
            del self._links[node_id]
            self._cut(known)

    def metadata(self, context: Context) -> Metadata:
        """The caller's credentials and trace context, marked as forwarded by this node."""
        received = cast(Iterable[tuple[str, str | bytes]], context.invocation_metadata() or ())
        passed = tuple((k, v) for k, v in received if k in PASSED_ON and isinstance(v, str))
        return (*passed, (FORWARDED_BY, self._node_id))

    async def unary(
        self,
        node: NodeRecord,
        method: str,
        request: bytes,
        context: Context,
        down: Callable[[], BrokerError],
        *,
        timeout_cap: float | None = None,
    ) -> bytes:
        """Forwards one unary call with the caller's deadline (at most `timeout_cap`);
        the owner's answer as bytes, or its failure raised (`down()` once the owner is
        counted down, even with no deadline)."""
        link = self._link(node)
        if link.cut:
            raise down()
        call = link.channel.unary_unary(
            method, request_serializer=_identity, response_deserializer=_identity
        )
        timeout = context.time_remaining()
        if timeout_cap is not None:
            timeout = timeout_cap if timeout is None else min(timeout, timeout_cap)
        try:
            response: bytes = await call(request, metadata=self.metadata(context), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise translate(exc, down) from None
        except asyncio.CancelledError:
            if cut_off(link):
                raise down() from None
            raise
        return response

    def stream(
        self, node: NodeRecord, method: str, metadata: Metadata
    ) -> tuple[Link, grpc.aio.StreamStreamCall[bytes, bytes]]:
        """Opens a bidirectional stream to `node`; the caller writes and reads bytes,
        and asks `cut_off(link)` when one of those is cancelled."""
        link = self._link(node)
        multi = link.channel.stream_stream(
            method, request_serializer=_identity, response_deserializer=_identity
        )
        return link, multi(None, metadata=metadata)

    def _link(self, node: NodeRecord) -> Link:
        known = self._links.get(node.node_id)
        if known is not None and known.record == node:
            return known
        addr = node.advertise_addr
        if self._credentials is None:
            channel = grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.aio.secure_channel(addr, self._credentials, options=CHANNEL_OPTIONS)
        link = Link(node, channel)
        if self._current.get(node.node_id, node) != node:
            # A record the caller read before the node left or changed: cut already.
            self._cut(link)
            return link
        if known is not None:
            self._cut(known)
        self._links[node.node_id] = link
        return link

    def _cut(self, link: Link) -> None:
        link.cut = True
        task = asyncio.get_running_loop().create_task(link.channel.close(None))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        links = list(self._links.values())
        self._links.clear()
        for link in links:
            await link.channel.close(None)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def translate(exc: grpc.aio.AioRpcError, down: Callable[[], BrokerError]) -> BrokerError:
    """The owner's failure as the error to answer with (see the module docstring)."""
    trailers = cast(Iterable[tuple[str, str | bytes]], exc.trailing_metadata() or ())
    kind = next(
        (v for k, v in trailers if k == ERROR_KIND_METADATA_KEY and isinstance(v, str)), None
    )
    code = exc.code()
    if kind is None and code == grpc.StatusCode.UNAVAILABLE:  # the node, not the broker
        return down()
    return RemoteError(code, kind, exc.details() or code.name.lower())
