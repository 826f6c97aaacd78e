"""Consumers: one per open `Consume` / `StreamConsume` stream, and each queue's ring of them.

A consumer holds at most `prefetch` unsettled leases (delivered or waiting to be
sent, and not yet acked, nacked or expired) and at most `max_buffered_bytes` of
messages not yet sent: buffered, or in the frame handed to gRPC whose write has not
returned (gRPC holds a frame until the client's HTTP/2 window lets it out, so a
client that does not read keeps its last frame in the broker). Those bounds, not the
stream's transport buffer, keep a slow or vanished consumer from hoarding messages or
memory: gRPC accepts writes as long as the client's transport keeps reading into its
own buffers, whether or not the application reads them. Once full, the scheduler
passes the consumer by and serves the others; a settled lease or a written frame
gives room back.

`ConsumerRing` is the only place that decides whether a consumer is *waiting*
(has room and sits in the round-robin of consumers the pump serves): the
invariant "waiting exactly while in the ring's deque" is kept by its methods alone.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

from fila.core.errors import BrokerError
from fila.core.records import Lease

_ids = itertools.count(1)


class BufferBudget:
    """Bytes not yet sent (buffered, or in a frame gRPC has not written) across every
    stream, against one broker-wide limit."""

    __slots__ = ("bytes", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0

    @property
    def exhausted(self) -> bool:
        return self.bytes >= self.limit


def _time_out(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class Consumer:
    __slots__ = (
        "_buffer",
        "_closed_with",
        "_waiter",
        "budget",
        "buffered_bytes",
        "capacity",
        "id",
        "max_batch",
        "max_buffered_bytes",
        "queue_name",
        "sending_bytes",
        "stream_leases",
        "unsettled",
        "waiting",
    )

    def __init__(
        self,
        queue_name: str,
        *,
        capacity: int,
        max_batch: int,
        max_buffered_bytes: int,
        budget: BufferBudget,
        owns_settlement: bool,
    ) -> None:
        self.id = next(_ids)
        self.queue_name = queue_name
        self.capacity = capacity
        self.max_batch = max_batch
        self.max_buffered_bytes = max_buffered_bytes
        self.budget = budget
        self._buffer: deque[tuple[Lease, bytes]] = deque()
        self._waiter: asyncio.Future[bool] | None = None
        self._closed_with: BrokerError | None = None
        self.unsettled = 0
        self.buffered_bytes = 0
        self.sending_bytes = 0  # taken into the frame being written; see `sent`
        # Set by ConsumerRing only: True while in its queue's round-robin of consumers.
        self.waiting = False
        # StreamConsume: the leases sent on this stream, which it alone may settle,
        # and which go back to the queue when the stream ends (keyed by message key).
        self.stream_leases: dict[bytes, Lease] | None = {} if owns_settlement else None

    @property
    def held_bytes(self) -> int:
        """Bytes of messages not yet sent: buffered, or in the frame being written."""
        return self.buffered_bytes + self.sending_bytes

    @property
    def has_room(self) -> bool:
        return (
            self.unsettled < self.capacity
            and self.buffered_bytes + self.sending_bytes < self.max_buffered_bytes
            and self._closed_with is None
        )

    @property
    def closed(self) -> bool:
        return self._closed_with is not None

    def offer(self, lease: Lease, record: bytes) -> None:
        """Buffers a delivery for the stream to send; counts it against the bytes (the
        lease already counts against prefetch: `LeaseTable.grant`)."""
        size = len(record)
        self.buffered_bytes += size
        self.budget.bytes += size
        self._buffer.append((lease, record))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def take(self, limit: int) -> list[tuple[Lease, bytes]]:
        """Up to `limit` buffered deliveries, oldest first, for the next frame; raises
        the close reason if closed. Their bytes stay counted (stream and budget) until
        `sent`: the frame is in the broker until gRPC has written it."""
        if self._closed_with is not None:
            raise self._closed_with
        buffer = self._buffer
        if not buffer:
            return []
        if limit >= len(buffer):
            taken = list(buffer)
            buffer.clear()
        else:
            taken = [buffer.popleft() for _ in range(limit)]
        size = sum(len(record) for _, record in taken)
        self.buffered_bytes -= size
        self.sending_bytes += size
        return taken

    def sent(self) -> None:
        """The frame of what `take` returned was written, or never will be: its bytes
        leave the stream's count and the budget."""
        self.budget.bytes -= self.sending_bytes
        self.sending_bytes = 0

    async def wait(self, timeout_s: float) -> bool:
        """Waits for a delivery or for close; False if `timeout_s` passed with neither.

        A bare future and a timer rather than `asyncio.wait_for`, whose own callback
        between the future and the task costs the delivery one more turn of the loop."""
        if self._buffer or self._closed_with is not None:
            return True
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        timer = loop.call_later(timeout_s, _time_out, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def close(self, reason: BrokerError) -> None:
        """Ends the stream with `reason` (the first reason given wins). What it holds
        stays until `release_unsent`, so whoever detaches it can give that back."""
        if self._closed_with is None:
            self._closed_with = reason
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def release_unsent(self) -> list[Lease]:
        """Empties the buffer; returns the leases whose messages were never sent. (A
        frame being written is released by `sent`, once its write returns.)"""
        unsent = [lease for lease, _ in self._buffer]
        self._buffer.clear()
        self.budget.bytes -= self.buffered_bytes
        self.buffered_bytes = 0
        return unsent


class ConsumerRing:
    """A queue's consumers, and the round-robin of those with room."""

    __slots__ = ("_waiting", "consumers")

    def __init__(self) -> None:
        self.consumers: dict[int, Consumer] = {}
        self._waiting: deque[Consumer] = deque()

    def __len__(self) -> int:
        return len(self.consumers)

    def add(self, consumer: Consumer) -> None:
        self.consumers[consumer.id] = consumer
        self._enlist(consumer)

    def remove(self, consumer: Consumer) -> bool:
        """Takes `consumer` out of the queue; False if it was not attached."""
        if self.consumers.pop(consumer.id, None) is None:
            return False
        if consumer.waiting:
            self._waiting.remove(consumer)
            consumer.waiting = False
        return True

    def next(self) -> Consumer | None:
        """The consumer whose turn it is, or None if none has room."""
        return self._waiting[0] if self._waiting else None

    def next_unbuffered(self) -> Consumer | None:
        """The next consumer with room and nothing buffered, brought to the head, or
        None. While the broker-wide buffer budget is spent, only such consumers are
        served (see `Delivery.pump`): streams that send what they get, not those
        whose buffers stand still (nor a frame gRPC cannot write). Scans the ring, but
        only while the budget is spent."""
        waiting = self._waiting
        for _ in range(len(waiting)):
            if waiting[0].held_bytes == 0:
                return waiting[0]
            waiting.rotate(-1)
        return None

    def served(self, consumer: Consumer) -> None:
        """`consumer` (the head) was just given a message: next turn, or out if full."""
        if consumer.has_room:
            self._waiting.rotate(-1)
        else:
            self._waiting.popleft()
            consumer.waiting = False

    def room_freed(self, consumer: Consumer) -> bool:
        """A slot or buffer space came back; True if the consumer is waiting again
        because of it (the queue then has someone new to serve)."""
        if consumer.waiting or consumer.id not in self.consumers or not consumer.has_room:
            return False
        self._enlist(consumer)
        return True

    def close_all(self, reason: BrokerError) -> list[Lease]:
        """Closes every consumer (queue deleted); returns their unsent leases."""
        unsent: list[Lease] = []
        for consumer in self.consumers.values():
            consumer.close(reason)
            unsent += consumer.release_unsent()
            consumer.waiting = False
        self.consumers.clear()
        self._waiting.clear()
        return unsent

    def _enlist(self, consumer: Consumer) -> None:
        if not consumer.waiting and consumer.has_room:
            self._waiting.append(consumer)
            consumer.waiting = True
