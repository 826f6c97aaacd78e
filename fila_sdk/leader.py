"""Following a cluster's leader hints for the streams the SDK opens (SPEC 9).

In cluster mode only a queue's owner serves its consume streams: any other node
refuses `Consume` and `StreamConsume` with UNAVAILABLE and names the owner in the
trailing metadata `x-fila-leader-addr`. Unary calls need nothing (every node answers
them), so only the consumers (`consume`, and the `Worker`'s stream) use this.

Each consumer keeps a `Follower`: where its stream goes. That is the client's own
address until a node names the owner; then the owner's, and the stream is opened
there at once (no backoff: nothing failed). When the stream fails otherwise (the
owner went away) the consumer goes back to the client's own address and the usual
reconnect loop takes over: the node there names the owner again once it serves, and
until then answers "queue q is on node 3, which is down", which backoff waits out.
So a consumer configured with any one node keeps working across the owner's
restarts.

A redirect is followed at once at most `MAX_HOPS` times in a row without a delivered
frame; the next one is treated as a failure (the consumer backs off once) before
redirects are followed again. So two nodes whose views disagree for a moment, or an
owner that is named but not answering yet, cannot make a consumer spin.

The channels to owners belong to the client (`SyncLeaders`, `AsyncLeaders`): one per
address, opened with the client's credentials and options on first use, shared by its
consumers, closed with the client.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import replace
from typing import Final, Generic, TypeVar, cast

import grpc
import grpc.aio

from fila.v1 import service_pb2_grpc
from fila.wire import LEADER_ADDR_METADATA_KEY

from ._channel import Settings

log = logging.getLogger("fila_sdk")

MAX_HOPS: Final = 3

Stub = TypeVar("Stub")


def leader_hint(err: grpc.RpcError) -> str | None:
    """The owner's address an UNAVAILABLE refusal names, if it names one."""
    if err.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    # Sync errors carry a tuple of pairs, grpc.aio ones a Metadata; both iterate as pairs.
    trailers = cast(Iterable[tuple[str, str | bytes]], err.trailing_metadata() or ())
    for key, value in trailers:
        if key == LEADER_ADDR_METADATA_KEY and isinstance(value, str) and value:
            return value
    return None


class _Leaders(Generic[Stub]):
    """A client's stubs for the owners its consumers were sent to, by address.

    The lock is for the blocking `Client`, whose consumers run in many threads: one
    channel per address, and none opened once the client is closing (a consumer
    redirected meanwhile gets the client's own, closed, stub and ends as it would
    have without cluster mode)."""

    def __init__(self, settings: Settings, home: Stub) -> None:
        self.settings = settings
        self.home = home
        self._stubs: dict[str, Stub] = {}
        self._lock = threading.Lock()
        self._closed = False

    def stub(self, addr: str | None) -> Stub:
        if addr is None:
            return self.home
        with self._lock:
            if self._closed:
                return self.home
            found = self._stubs.get(addr)
            if found is None:
                found = self._stubs[addr] = self._open(replace(self.settings, target=addr))
            return found

    def _open(self, settings: Settings) -> Stub:
        raise NotImplementedError

    def _close(self) -> None:
        """Opens no more channels; the subclass then closes those it opened."""
        with self._lock:
            self._closed = True
            self._stubs.clear()


class SyncLeaders(_Leaders[service_pb2_grpc.FilaServiceStub]):
    def __init__(self, settings: Settings, home: service_pb2_grpc.FilaServiceStub) -> None:
        super().__init__(settings, home)
        self._channels: list[grpc.Channel] = []

    def _open(self, settings: Settings) -> service_pb2_grpc.FilaServiceStub:
        channel = settings.sync_channel()
        self._channels.append(channel)
        return service_pb2_grpc.FilaServiceStub(channel)

    def close(self) -> None:
        self._close()
        for channel in self._channels:
            channel.close()


class AsyncLeaders(_Leaders["service_pb2_grpc.FilaServiceAsyncStub"]):  # (a stub-only type)
    def __init__(self, settings: Settings, home: service_pb2_grpc.FilaServiceAsyncStub) -> None:
        super().__init__(settings, home)
        self._channels: list[grpc.aio.Channel] = []

    def _open(self, settings: Settings) -> service_pb2_grpc.FilaServiceAsyncStub:
        channel = settings.aio_channel()
        self._channels.append(channel)
        stub: service_pb2_grpc.FilaServiceAsyncStub = service_pb2_grpc.FilaServiceStub(channel)
        return stub

    async def close(self) -> None:
        self._close()
        for channel in self._channels:
            await channel.close(None)


class Follower(Generic[Stub]):
    """One consumer's way to its queue's owner (see the module docstring)."""

    __slots__ = ("_leaders", "_what", "addr", "hops")

    def __init__(self, leaders: _Leaders[Stub], what: str) -> None:
        self._leaders = leaders
        self._what = what
        self.addr: str | None = None  # the owner's address, while following one
        self.hops = 0

    @property
    def service(self) -> Stub:
        """The stub to open the stream with: the owner's, or the client's own."""
        return self._leaders.stub(self.addr)

    def follow(self, err: grpc.RpcError) -> bool:
        """True if `err` names the queue's owner: open the stream again at once, with
        `service`, which now goes there."""
        addr = leader_hint(err)
        if addr is None:
            return False
        if self.hops >= MAX_HOPS:  # a failure: the caller calls `lost` and backs off
            return False
        self.hops += 1
        if addr != self.addr:
            log.info("%s: the queue is served at %s; consuming there", self._what, addr)
        self.addr = None if addr == self._leaders.settings.target else addr
        return True

    def lost(self) -> None:
        """The stream failed otherwise: start again from the client's own address,
        after the caller's backoff (so the hops count starts over too)."""
        self.addr = None
        self.hops = 0

    def delivered(self) -> None:
        """A frame arrived: the next redirect is followed at once again."""
        self.hops = 0
