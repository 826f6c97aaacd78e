"""Deadlines the scheduler must act on: lease expiry, delayed messages, throttle wake-ups.

One heap and one pending `call_later` handle for the earliest entry, instead of
a timer handle per message. Entries are not removed when their subject ends (a
lease that was acked); the callback checks whether it is still current. So that a
long visibility timeout under heavy traffic does not pile up dead entries, the
heap is swept whenever it doubles: it becomes the old heap, new entries go to a
fresh one, and the sweep moves the old heap's live entries over `SWEEP_SLICE` at a
time, taking them from the end of its array (which keeps it a heap) with a turn of
the loop between slices. Both heaps serve due entries meanwhile, the earlier head
first. Rebuilding in one go was O(entries) in one turn: 369 ms for a million.

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

_MIN_SWEEP = 10_000
# Entries a loop-driven turn runs at most (see the module docstring).
PER_TURN = 1000
# Old-heap entries one slice of a sweep looks at (about a millisecond of work).
SWEEP_SLICE = 2000

_Entry = tuple[int, int, Callable[[Any], None], Any]


class Timers:
    def __init__(
        self, clock: Clock, is_live: Callable[[Any], bool], *, loop_driven: bool = True
    ) -> None:
        """`loop_driven=False`: the sweep also advances only when `run_due` is called,
        one slice a call."""
        self._clock = clock
        self._is_live = is_live
        self._loop_driven = loop_driven
        self._sweep_above = _MIN_SWEEP
        self._heap: list[_Entry] = []
        # The heap being swept (empty when no sweep runs), and its next slice's handle.
        self._old: list[_Entry] = []
        self._sweep_handle: asyncio.Handle | None = None
        self._seq = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for: int | None = None
        self.failures = 0

    def at(self, when_ms: int, callback: Callable[[Any], None], arg: Any) -> None:
        heapq.heappush(self._heap, (when_ms, next(self._seq), callback, arg))
        if len(self._heap) > self._sweep_above and not self._old:
            self._start_sweep()
        if self._loop_driven and (self._armed_for is None or when_ms < self._armed_for):
            self._arm()

    def __len__(self) -> int:
        return len(self._heap) + len(self._old)

    @property
    def sweeping(self) -> bool:
        return bool(self._old)

    def next_due_ms(self) -> int | None:
        head = self._head()
        return None if head is None else head[0][0]

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        self._heap.clear()
        self._old.clear()

    def run_due(self, limit: int | None = None) -> None:
        """Runs the entries whose time has come, in time order: every one, or at most
        `limit` (those left are still due, and run first next time)."""
        if not self._loop_driven and self._old:
            self._sweep_slice()
        now = self._clock.now_ms()
        budget = -1 if limit is None else limit  # -1: no limit (it never reaches 0)
        while budget != 0 and (head := self._head()) is not None and head[0][0] <= now:
            budget -= 1
            _, _, callback, arg = heapq.heappop(head)
            try:
                callback(arg)
            except Exception:
                self.failures += 1
                log.exception(
                    "a timer callback failed; the timers carry on",
                    extra={"callback": getattr(callback, "__qualname__", repr(callback))},
                )

    def _head(self) -> list[_Entry] | None:
        """The heap holding the earliest entry, or None when both are empty."""
        heap, old = self._heap, self._old
        if not old:
            return heap or None
        if not heap or old[0] < heap[0]:
            return old
        return heap

    def _start_sweep(self) -> None:
        self._old, self._heap = self._heap, []
        if self._loop_driven:
            self._sweep_handle = asyncio.get_running_loop().call_soon(self._sweep_slice)

    def _sweep_slice(self) -> None:
        """Moves the live entries of up to `SWEEP_SLICE` old-heap entries to the heap."""
        self._sweep_handle = None
        old, heap, is_live = self._old, self._heap, self._is_live
        for _ in range(min(SWEEP_SLICE, len(old))):
            entry = old.pop()  # the last leaf: what is left is still a heap
            if is_live(entry[3]):
                heapq.heappush(heap, entry)
        if old:
            if self._loop_driven:
                self._sweep_handle = asyncio.get_running_loop().call_soon(self._sweep_slice)
            return
        self._sweep_above = max(_MIN_SWEEP, 2 * len(heap))
        if self._loop_driven and self._armed_for is not None:
            self._arm()  # the earliest entry may have been dropped

    def _arm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._armed_for = None
        when = self.next_due_ms()
        if when is None:
            return
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
