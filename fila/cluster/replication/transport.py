"""The replication protocol over gRPC (`ports.Transport`): one `Follow` stream from a
follower node to each node leading queues it follows (`fila.internal.v1`).

A follower's messages (subscriptions, acknowledgements) go up the stream it opened to
the leader node, opened on first use with the node's own credentials (the bootstrap
API key with `[auth]`, its certificate with mTLS: see `fila.cluster.peers`); the
leader's messages go down the stream the follower node opened to it, and are dropped
when there is none (the follower subscribes again). Messages of one event-loop turn
to one node travel as one frame. A stream that fails or ends is closed, and the
protocol is told (`lost`), so the follower's sessions on it start over at once rather
than after their silence times out. Delivery is best effort throughout: the protocol
numbers everything and asks again for what it lacks.

The calls on the stream are authorized as superadmin calls: the method is not in
`fila.server.access.RULES`, and a method missing there is reserved to superadmins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, TypeAlias

import grpc
import grpc.aio

from fila.cluster.nodes import Nodes
from fila.cluster.peers import Link, Peers, cut_off
from fila.cluster.replication import wire
from fila.cluster.replication.messages import Ack, Message, Subscribe
from fila.internal.v1 import replication_pb2 as pb

log = logging.getLogger("fila.cluster.replication")

SERVICE: Final = "fila.internal.v1.Replication"
METHOD: Final = f"/{SERVICE}/Follow"

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Receiver = Callable[[int, Message], None]


class GrpcTransport:
    def __init__(
        self,
        node_id: int,
        peers: Peers,
        nodes: Nodes,
        metadata: tuple[tuple[str, str], ...],
    ) -> None:
        self._node_id = node_id
        self._peers = peers
        self._nodes = nodes
        self._metadata = metadata
        self._receive: Receiver = _nobody
        self._lost: Callable[[int], None] = lambda node_id: None
        self._up: dict[int, _Up] = {}  # streams this node opened, to the leaders it follows
        self._down: dict[int, _Down] = {}  # streams followers opened here
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def connect(self, receive: Receiver, lost: Callable[[int], None]) -> None:
        """Where received messages go, and who hears of a stream that ended."""
        self._receive = receive
        self._lost = lost

    # -- sending ---------------------------------------------------------------------------

    def send(self, node_id: int, message: Message) -> None:
        if self._closed:
            return
        if isinstance(message, Subscribe | Ack):
            up = self._up.get(node_id) or self._open(node_id)
            if up is not None:
                up.push(wire.follower_item(message))
        else:
            down = self._down.get(node_id)
            if down is not None:
                down.push(wire.leader_item(message))

    def _open(self, node_id: int) -> _Up | None:
        node = self._nodes.get(node_id)
        if node is None:
            return None  # down: the protocol asks again once it is back
        link, call = self._peers.stream(node, METHOD, self._metadata)
        up = _Up(self, node_id, link, call)
        self._up[node_id] = up
        self._spawn(up.run(), f"fila-replication-up-{node_id}")
        return up

    def _spawn(self, work: Any, name: str) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ended(self, node_id: int, stream: _Up | _Down) -> None:
        if self._up.get(node_id) is stream:
            del self._up[node_id]
        if self._down.get(node_id) is stream:
            del self._down[node_id]
        if not self._closed:
            self._lost(node_id)

    # -- receiving: the Follow handler -------------------------------------------------------

    async def follow(self, frames: AsyncIterator[pb.FollowerFrame], context: Context) -> None:
        """The server side of a follower's stream: its messages to the protocol, the
        protocol's answers down the stream, until either side ends it."""
        down: _Down | None = None
        try:
            async for frame in frames:
                if down is None:
                    down = _Down(context)
                    node_id = frame.node_id
                    old = self._down.get(node_id)
                    self._down[node_id] = down
                    if old is not None:
                        old.close()
                    writer = asyncio.get_running_loop().create_task(
                        down.run(), name=f"fila-replication-down-{node_id}"
                    )
                for item in frame.items:
                    message = wire.from_follower(item)
                    if message is not None:
                        self._receive(frame.node_id, message)
        finally:
            if down is not None:
                down.close()
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
                self._ended(node_id, down)

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        follow = grpc.stream_stream_rpc_method_handler(
            self.follow,
            request_deserializer=pb.FollowerFrame.FromString,
            response_serializer=pb.LeaderFrame.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"Follow": follow})

    # -- the end ---------------------------------------------------------------------------

    async def close(self) -> None:
        self._closed = True
        for up in list(self._up.values()):
            up.close()
        for down in list(self._down.values()):
            down.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


class _Frames:
    """Items pushed during one loop turn, written as one frame by the stream's writer."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._scheduled = False
        self.queue: asyncio.Queue[list[Any] | None] = asyncio.Queue()

    def push(self, item: Any) -> None:
        self._items.append(item)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        items, self._items = self._items, []
        if items:
            self.queue.put_nowait(items)

    def close(self) -> None:
        self.queue.put_nowait(None)


class _Up(_Frames):
    """A stream this node opened to a leader node."""

    def __init__(
        self,
        transport: GrpcTransport,
        node_id: int,
        link: Link,
        call: grpc.aio.StreamStreamCall[bytes, bytes],
    ) -> None:
        super().__init__()
        self._transport = transport
        self._node_id = node_id
        self._link = link
        self._call = call
        self._heard = False

    async def run(self) -> None:
        writer = asyncio.get_running_loop().create_task(self._write())
        try:
            await self._read()
        except grpc.aio.AioRpcError as exc:
            # Said once per stream that worked; attempts at a node that is down are quiet.
            level = logging.INFO if self._heard else logging.DEBUG
            log.log(
                level, "replication stream to node %d ended: %s", self._node_id, exc.code().name
            )
        except asyncio.CancelledError:
            if not cut_off(self._link):
                raise
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await writer
            self._call.cancel()
            self._transport._ended(self._node_id, self)

    async def _read(self) -> None:
        receive = self._transport._receive
        async for raw in self._call:
            self._heard = True
            for item in pb.LeaderFrame.FromString(raw).items:
                message = wire.from_leader(item)
                if message is not None:
                    receive(self._node_id, message)

    async def _write(self) -> None:
        node_id = self._transport._node_id
        while (items := await self.queue.get()) is not None:
            frame = pb.FollowerFrame(node_id=node_id, items=items)
            await self._call.write(frame.SerializeToString())
        self._call.cancel()


class _Down(_Frames):
    """A stream a follower node opened here."""

    def __init__(self, context: Context) -> None:
        super().__init__()
        self._context = context

    async def run(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            while (items := await self.queue.get()) is not None:
                await self._context.write(pb.LeaderFrame(items=items))


def _nobody(node_id: int, message: Message) -> None:
    log.debug("replication message before the protocol was connected, dropped")
