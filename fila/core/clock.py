"""The broker's single source of time.

Deadlines (leases, delayed messages) are persisted, so they are wall-clock
milliseconds that stay meaningful across a restart. Token buckets only need
elapsed time, but use the same clock so one injected clock drives everything:
the in-process tests of the core run on `ManualClock` and move time themselves
instead of sleeping.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...

    def now_s(self) -> float: ...


class SystemClock:
    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def now_s(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to (tests)."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._ms = start_ms

    def now_ms(self) -> int:
        return self._ms

    def now_s(self) -> float:
        return self._ms / 1000.0

    def advance(self, ms: int) -> None:
        self._ms += ms
