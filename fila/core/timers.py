"""Deadlines the scheduler must act on: lease expiry, delayed messages, throttle wake-ups.

One heap and one pending `call_later` handle for the earliest entry, instead of
a timer handle per message. Entries are not removed when their subject ends (a
lease that was acked); the callback checks whether it is still current. So that a
long visibility timeout under heavy traffic does not pile up dead entries, the
heap is rebuilt from live entries whenever it doubles.

With `loop_driven=False` nothing is armed on the event loop: whoever drives the
clock (a test on a `ManualClock`) calls `run_due()` after moving time.

Entries run at most `PER_TURN` to a turn of the event loop, the rest on the turns
after, others served between: a million delays due at once, or the leases and delays
that fell due while the broker was down, do not hold the loop.

A callback that raises is a bug, but it must not take the timers with it: the
error is logged with its traceback and counted (`failures`), the entries after it
still run, and the next one is armed, so one bad lease cannot leave every later
deadline of the broker unserved.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Callable
from typing import Any

from fila.clock import Clock

log = logging.getLogger("fila.timers")

_MIN_COMPACT = 10_000
# Entries a loop-driven turn runs at most (see the module docstring).
PER_TURN = 1000


class Timers:
    def __init__(
        self, clock: Clock, is_live: Callable[[Any], bool], *, loop_driven: bool = True
    ) -> None:
        self._clock = clock
        self._is_live = is_live
        self._loop_driven = loop_driven
        self._compact_above = _MIN_COMPACT
        self._heap: list[tuple[int, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for: int | None = None
        self.failures = 0

    def at(self, when_ms: int, callback: Callable[[Any], None], arg: Any) -> None:
        heapq.heappush(self._heap, (when_ms, next(self._seq), callback, arg))
        if len(self._heap) > self._compact_above:
            self._compact()
        if self._loop_driven and (self._armed_for is None or when_ms < self._armed_for):
            self._arm()

    def __len__(self) -> int:
        return len(self._heap)

    def next_due_ms(self) -> int | None:
        return self._heap[0][0] if self._heap else None

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._heap.clear()

    def run_due(self, limit: int | None = None) -> None:
        """Runs the entries whose time has come, in time order: every one, or at most
        `limit` (those left are still due, and run first next time)."""
        now = self._clock.now_ms()
        heap = self._heap
        budget = -1 if limit is None else limit  # -1: no limit (it never reaches 0)
        while heap and heap[0][0] <= now and budget != 0:
            budget -= 1
            _, _, callback, arg = heapq.heappop(heap)
            try:
                callback(arg)
            except Exception:
                self.failures += 1
                log.exception(
                    "a timer callback failed; the timers carry on",
                    extra={"callback": getattr(callback, "__qualname__", repr(callback))},
                )

    def _compact(self) -> None:
        is_live = self._is_live
        self._heap = [entry for entry in self._heap if is_live(entry[3])]
        heapq.heapify(self._heap)
        self._compact_above = max(_MIN_COMPACT, 2 * len(self._heap))
        self._armed_for = None  # the earliest entry may have been dropped; re-arm

    def _arm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._armed_for = None
        if not self._heap:
            return
        when = self._heap[0][0]
        delay = max(0.0, (when - self._clock.now_ms()) / 1000.0)
        self._handle = asyncio.get_running_loop().call_later(delay, self._fire)
        self._armed_for = when

    def _fire(self) -> None:
        self._handle = None
        self._armed_for = None
        try:
            self.run_due(PER_TURN)
        finally:
            self._arm()  # at once, on the next turn, if some that are due are left
