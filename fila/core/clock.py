"""The broker's single source of time.

Deadlines (leases, delayed retries) are persisted, so they are wall-clock
milliseconds that stay meaningful across a restart. Token buckets only need
elapsed time, but use the same clock so one injected clock drives everything.
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
