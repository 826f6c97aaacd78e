"""Deadlines the scheduler must act on: lease expiry, delayed retries, throttle wake-ups.

One heap and one pending `call_later` handle for the earliest entry, instead
of a timer handle per message. Entries are never removed; the callback checks
whether its subject is still current (a lease that was acked is inactive).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from typing import Any

from fila.core.clock import Clock


class Timers:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._heap: list[tuple[int, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        self._armed_for: int | None = None

    def at(self, when_ms: int, callback: Callable[[Any], None], arg: Any) -> None:
        heapq.heappush(self._heap, (when_ms, next(self._seq), callback, arg))
        if self._armed_for is None or when_ms < self._armed_for:
            self._arm()

    def __len__(self) -> int:
        return len(self._heap)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._heap.clear()

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
        now = self._clock.now_ms()
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, callback, arg = heapq.heappop(heap)
            callback(arg)
        self._arm()
