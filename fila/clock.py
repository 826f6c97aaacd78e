"""The broker's single source of time.

Deadlines (leases, delayed messages) are persisted, so they are wall-clock
milliseconds that stay meaningful across a restart. Token buckets only need
elapsed time, but use the same clock so one injected clock drives everything:
the in-process tests of the core run on `ManualClock` and move time themselves
instead of sleeping.

A running broker reads `SteadyClock`: the wall clock as it was at start, advanced by
the monotonic clock since. The event loop's timers run on the monotonic clock, and
the system's wall clock can jump (an NTP step, a VM resumed or migrated): read
directly, a step forward expired every lease at once (messages delivered again while
their consumers still held them) and stalled every timer behind the one armed before
the step; a step back froze leases, delays, throttles and the Lua breaker for its
length. Counted this way, durations within a run are exact whatever the system clock
does, and the persisted times differ from the system clock only by the steps it took
while the broker ran (NTP's gradual slewing moves both clocks alike); a restart reads
the wall clock again, and recovery bounds what a step between runs can do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int: ...

    def now_ns(self) -> int:
        """The same time in nanoseconds, exact: elapsed times are differences of these
        (a float of seconds since 1970 keeps only about 0.2 us)."""
        ...


class SystemClock:
    """The system's wall clock as it is at each read: for what must follow the calendar
    even when the clock is stepped (an API key's expiry), never for the core's timers."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def now_ns(self) -> int:
        return time.time_ns()


class SteadyClock:
    """Wall-clock time as of construction, advanced by the monotonic clock since (see
    the module docstring). `wall_ns` and `monotonic_ns` are the sources, for tests."""

    def __init__(
        self,
        wall_ns: Callable[[], int] = time.time_ns,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._monotonic_ns = monotonic_ns
        self._offset_ns = wall_ns() - monotonic_ns()

    def now_ms(self) -> int:
        return (self._monotonic_ns() + self._offset_ns) // 1_000_000

    def now_ns(self) -> int:
        return self._monotonic_ns() + self._offset_ns


class ManualClock:
    """A clock that moves only when told to (tests)."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._ms = start_ms

    def now_ms(self) -> int:
        return self._ms

    def now_ns(self) -> int:
        return self._ms * 1_000_000

    def advance(self, ms: int) -> None:
        self._ms += ms
