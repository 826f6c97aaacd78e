"""How late the event loop runs what is due: the broker's loop lag (`fila.loop.lag`).

Every request, delivery, timer and commit of the broker runs on one event loop, so
whatever holds the loop for 50 ms holds every client for as long. A callback due
every `INTERVAL_S` notes how late it actually runs (the loop's clock when it runs,
minus when it was due) in a fixed-bucket histogram, which the exporters read at
collection like the core's others (`fila.telemetry.histogram`): a loop that keeps up
shows a millisecond or less, and a single call that holds the loop for a second shows
as one sample near a second. Its cost is in docs/benchmarks.md; it runs only while an
exporter does (`fila.telemetry.exporters`).
"""

from __future__ import annotations

import asyncio

from fila.telemetry.histogram import LOOP_LAG_BOUNDS_S, FixedHistogram

INTERVAL_S = 0.05


class LoopLag:
    """Samples the lag of one event loop, from `start` until `stop`."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.seconds = FixedHistogram(LOOP_LAG_BOUNDS_S)
        self._interval = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._arm(loop.time())

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _arm(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self._interval
        self._handle = self._loop.call_at(self._due, self._sample)

    def _sample(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        self.seconds.record(max(0.0, now - self._due))
        self._arm(now)
