"""The leases a worker holds, and the heartbeat that keeps long handlers' leases alive.

A message held longer than a third of the queue's visibility timeout gets
`ExtendLease` (to the queue's full timeout), so long handlers keep their messages.
The timeout is not sent to consumers: `visibility_timeout` gives it, or the worker
learns it from its first extension (`ExtendLease` answers the new deadline, and
`leased_at` on the delivery tells where the broker's clock stood).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Final

from ..aio import AsyncClient
from ..errors import FilaError, MessageNotFoundError
from ..types import Message
from .options import Options, WorkerStats

log = logging.getLogger("fila_sdk")

# Until the visibility timeout is known, held messages are checked this often.
_UNKNOWN_TIMEOUT_TICK_S: Final = 1.0
# Most lease extensions in flight at once.
_EXTEND_CONCURRENCY: Final = 64


class Leases:
    """What the worker holds, by message id, with the monotonic time each lease was
    last granted or extended: `held` on the current stream (buffered or running), and
    `orphans`, running messages whose stream ended or whose lease was found gone (they
    are settled by unary calls, never on a stream); and the heartbeat that extends
    them (see the module docstring).

    A lease found gone (NOT_FOUND: it expired) is never settled on the stream:
    `gone(message_id)` drops the message if it was only buffered (and says True), else
    it becomes an orphan. `connected` is set while a stream is open."""

    def __init__(
        self,
        client: AsyncClient,
        options: Options,
        connected: asyncio.Event,
        gone: Callable[[str], bool],
        stats: WorkerStats,
    ) -> None:
        self._client = client
        self._queue = options.queue
        self._connected = connected
        self._gone = gone
        self._stats = stats
        self.held: dict[str, float] = {}
        self.orphans: dict[str, float] = {}
        self.timeout_s = options.visibility_timeout_s
        # For learning the visibility timeout: id -> (leased_at ms, monotonic receipt).
        self._origin: dict[str, tuple[int, float]] = {}
        self._held_wake = asyncio.Event()

    def delivered(self, messages: list[Message]) -> None:
        now = time.monotonic()
        held = self.held
        for message in messages:
            held[message.id] = now
        if self.timeout_s is None and messages:
            first = messages[0]
            if first.leased_at is not None:
                leased_at_ms = round(first.leased_at.timestamp() * 1000)
                self._origin[first.id] = (leased_at_ms, now)
        self._held_wake.set()

    def end(self, message_id: str) -> bool:
        """The message is settled: True if it was held on the current stream."""
        self._origin.pop(message_id, None)
        return self.held.pop(message_id, None) is not None

    def stream_lost(self, buffered: Iterable[str]) -> int:
        """The stream ended: the `buffered` messages (not started) are the broker's
        again, the running ones become orphans. Returns how many were released."""
        held = self.held
        released = 0
        for message_id in buffered:
            if held.pop(message_id, None) is not None:
                released += 1
            self._origin.pop(message_id, None)
        self.orphans.update(held)
        held.clear()
        return released

    def release_all(self) -> int:
        """The worker ended: everything it held is released; returns how many."""
        released = len(self.held) + len(self.orphans)
        self.held.clear()
        self.orphans.clear()
        self._origin.clear()
        return released

    async def heartbeat(self) -> None:
        """Extends what is held long enough, until cancelled."""
        while True:
            if self.timeout_s is None:
                await self._learn_timeout()
                continue
            period = self.timeout_s / 3
            await asyncio.sleep(period / 2)
            if not self._connected.is_set():
                continue  # the broker is away: extensions would only fail (and log)
            now = time.monotonic()
            due = [
                message_id
                for table in (self.held, self.orphans)
                for message_id, since in table.items()
                if now - since >= period
            ]
            if due:
                await self._extend(due)

    async def _learn_timeout(self) -> None:
        """Extends the oldest held message by the queue's own timeout and derives the
        timeout from the answer: deadline - leased_at - time held since delivery."""
        if not self.held:
            self._held_wake.clear()
            await self._held_wake.wait()
        origin = self._origin
        candidates = [mid for mid in self.held if mid in origin]
        if not candidates:
            await asyncio.sleep(_UNKNOWN_TIMEOUT_TICK_S)
            return
        message_id = candidates[0]
        leased_at_ms, received = origin[message_id]
        try:
            deadline = await self._client.extend_lease(self._queue, message_id)
        except MessageNotFoundError:
            origin.pop(message_id, None)
            return  # settled meanwhile: try the next one
        except FilaError as exc:
            log.debug("worker on %r: lease probe failed: %s", self._queue, exc)
            await asyncio.sleep(_UNKNOWN_TIMEOUT_TICK_S)
            return
        held_s = time.monotonic() - received
        timeout_ms = deadline.timestamp() * 1000 - leased_at_ms - held_s * 1000
        self.timeout_s = max(timeout_ms, 1.0) / 1000
        origin.clear()
        if message_id in self.held:
            self.held[message_id] = time.monotonic()
        log.debug("worker on %r: visibility timeout is about %.3fs", self._queue, self.timeout_s)

    async def _extend(self, message_ids: list[str]) -> None:
        gate = asyncio.Semaphore(_EXTEND_CONCURRENCY)
        queue = self._queue

        async def extend(message_id: str) -> None:
            async with gate:
                try:
                    await self._client.extend_lease(queue, message_id)
                except MessageNotFoundError:
                    self._lease_gone(message_id)
                    return
                except FilaError as exc:
                    log.warning("worker on %r: extending %s failed: %s", queue, message_id, exc)
                    return
            self._stats.extended += 1
            now = time.monotonic()
            if message_id in self.held:
                self.held[message_id] = now
            elif message_id in self.orphans:
                self.orphans[message_id] = now

        await asyncio.gather(*(extend(m) for m in message_ids))

    def _lease_gone(self, message_id: str) -> None:
        if self.held.pop(message_id, None) is None:
            self.orphans.pop(message_id, None)
            return
        if not self._gone(message_id):
            self.orphans[message_id] = time.monotonic()
