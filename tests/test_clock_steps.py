"""The system clock stepped (NTP, a VM resumed or migrated) must not stall or rush the
broker's timers, while it runs or between two runs.

The event loop arms timers on the monotonic clock; the core's deadlines are wall-clock
milliseconds, because they are persisted. Read straight from the system clock, a step
forward of two hours expired every lease at once (messages delivered again while their
consumers held them) and left a 100 ms timer waiting behind the one armed for an hour
before the step; a step back of two hours froze leases, delays and throttles for two
hours. `SteadyClock` counts elapsed time on the monotonic clock from the wall clock read
at start; recovery bounds a lease or a delay stored before a step back to its length
(tests/core/test_recovery.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from fila.clock import SteadyClock
from fila.core.timers import Timers

HOUR_MS = 3_600_000
HOUR_NS = HOUR_MS * 1_000_000
PROMPT_S = 2.0  # a timer due in 100-200 ms fires well within this, on any host


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


class SteppedWallClock:
    """The system's wall clock, moved by hand as an NTP step would move it."""

    def __init__(self) -> None:
        self.step_ns = 0

    def __call__(self) -> int:
        return time.time_ns() + self.step_ns


def test_steady_time_counts_what_the_monotonic_clock_counts_whatever_the_wall_does() -> None:
    wall = iter([1_700_000_000_000_000_000])
    monotonic = [5_000_000_000]
    clock = SteadyClock(wall_ns=lambda: next(wall), monotonic_ns=lambda: monotonic[0])
    assert clock.now_ms() == 1_700_000_000_000
    monotonic[0] += 1_500_000_000
    assert clock.now_ms() == 1_700_000_001_500  # the wall clock is read once only
    assert clock.now_ns() == 1_700_000_001_500_000_000


async def _fires_promptly(timers: Timers, clock: SteadyClock, delay_ms: int) -> bool:
    fired = asyncio.Event()
    timers.at(clock.now_ms() + delay_ms, lambda _: fired.set(), None)
    try:
        await asyncio.wait_for(fired.wait(), PROMPT_S)
    except TimeoutError:
        return False
    return True


def test_a_step_forward_neither_stalls_timers_nor_fires_them_early() -> None:
    async def scenario() -> None:
        wall = SteppedWallClock()
        clock = SteadyClock(wall_ns=wall)
        timers = Timers(clock, lambda _: True)  # armed on the running loop, as in fila-server
        early: list[str] = []
        timers.at(clock.now_ms() + HOUR_MS, early.append, "an hour's lease")
        wall.step_ns = 2 * HOUR_NS
        assert await _fires_promptly(timers, clock, 100), "a 100 ms timer waited behind the hour"
        assert early == [], "a lease of an hour expired after a step of the system clock"
        timers.close()

    run(scenario)


def test_a_step_back_does_not_freeze_timers() -> None:
    async def scenario() -> None:
        wall = SteppedWallClock()
        clock = SteadyClock(wall_ns=wall)
        timers = Timers(clock, lambda _: True)
        due = asyncio.Event()
        timers.at(clock.now_ms() + 200, lambda _: due.set(), None)
        wall.step_ns = -HOUR_NS
        await asyncio.wait_for(due.wait(), PROMPT_S)
        assert await _fires_promptly(timers, clock, 100)
        timers.close()

    run(scenario)
