"""One open `Consume` stream, seen from the scheduler.

A consumer holds at most `capacity` unsettled leases: delivered or waiting to be
sent, and not yet acked, nacked or expired (like a prefetch count). That bound,
not the stream's buffer, is what keeps a slow or vanished consumer from
hoarding messages: gRPC accepts writes as long as the client's transport keeps
reading into its own buffers, whether or not the application reads them. Once
full, the scheduler passes the consumer by and serves the others; a settled
lease gives the slot back. Frames are fully encoded before they are buffered,
so the stream handler only writes bytes.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

from fila.core.errors import BrokerError
from fila.core.records import Lease

_ids = itertools.count(1)


class Consumer:
    __slots__ = (
        "_buffer",
        "_closed_with",
        "_waiter",
        "capacity",
        "id",
        "queue_name",
        "unsettled",
        "waiting",
    )

    def __init__(self, queue_name: str, capacity: int) -> None:
        self.id = next(_ids)
        self.queue_name = queue_name
        self.capacity = capacity
        self._buffer: deque[tuple[Lease, bytes]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed_with: BrokerError | None = None
        self.unsettled = 0
        # True while the consumer sits in its queue's list of consumers with room.
        self.waiting = False

    @property
    def has_room(self) -> bool:
        return self.unsettled < self.capacity and self._closed_with is None

    @property
    def closed(self) -> bool:
        return self._closed_with is not None

    def offer(self, lease: Lease, frame: bytes) -> None:
        self.unsettled += 1
        self._buffer.append((lease, frame))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> tuple[Lease, bytes] | None:
        """The next buffered delivery, or None when the buffer is empty."""
        if self._closed_with is not None:
            raise self._closed_with
        return self._buffer.popleft() if self._buffer else None

    async def wait(self, timeout_s: float) -> bool:
        """Waits for a delivery or for close; False if `timeout_s` passed with neither."""
        if self._buffer or self._closed_with is not None:
            return True
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self._waiter, timeout_s)
        except TimeoutError:
            return False
        finally:
            self._waiter = None
        return True

    def close(self, reason: BrokerError) -> list[Lease]:
        """Ends the stream with `reason`; returns the leases that were never sent."""
        self._closed_with = reason
        unsent = [lease for lease, _ in self._buffer]
        self._buffer.clear()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return unsent
