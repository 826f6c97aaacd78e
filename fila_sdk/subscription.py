"""One consumer's stream across its ends, for `Client.consume`, `AsyncClient.consume`
and the `Worker`: where to open it, what a frame carries, and what an ending means.

A consumer is long-lived and outlives the streams it opens. In a cluster it opens its
stream on the queue's owner (`fila_sdk.leader`); when the broker goes away it backs
off and opens it again (`fila_sdk.retry`); any frame tells that the stream works
again, which resets both. Each client reads the stream its own way (blocking or
awaited); the decisions are made here once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, TypeVar

import grpc

from fila.v1 import messages_pb2, service_pb2

from ._channel import map_rpc_error
from .errors import FilaError
from .leader import Follower, _Leaders
from .retry import Reconnector, retryable

Stub = TypeVar("Stub")


class Subscription(Generic[Stub]):
    """A consumer of `what` (for the log, e.g. "consumer of 'orders'"), following
    `leaders` to its queue's owner, and backing off with `reconnector`."""

    __slots__ = ("follower", "reconnector")

    def __init__(self, what: str, leaders: _Leaders[Stub], reconnector: Reconnector) -> None:
        self.reconnector = reconnector
        self.follower = Follower(leaders, what)

    @property
    def service(self) -> Stub:
        """The stub to open the stream with: the queue's owner's, or the client's own."""
        return self.follower.service

    @property
    def owner(self) -> Stub | None:
        """The owner's stub while following one, else None (any connection will do)."""
        return self.follower.service if self.follower.addr else None

    def messages(self, frame: service_pb2.ConsumeResponse) -> Sequence[messages_pb2.Message]:
        """The messages `frame` carries (none for a keepalive). A frame also means the
        stream works: backoff and the redirect count start over."""
        if self.reconnector.backing_off:
            self.reconnector.delivered()
        if self.follower.hops:
            self.follower.delivered()
        batch = frame.messages
        if batch:
            return batch
        if frame.HasField("message"):
            return (frame.message,)
        return ()

    def redirected(self, err: grpc.RpcError) -> bool:
        """True if `err` names the queue's owner: open the stream again at once, with
        `service`. Otherwise the stream is lost, and the next one starts from the
        client's own address after the caller's backoff."""
        if self.follower.follow(err):
            return True
        self.follower.lost()
        return False

    def failed(self, err: grpc.RpcError, rpc: str) -> FilaError:
        """The error to back off on after `err` ended the `rpc` stream; raises it
        instead when opening the stream again cannot help (a missing queue, a refused
        key)."""
        error = map_rpc_error(err, rpc)
        if not retryable(error):
            raise error from err
        return error
