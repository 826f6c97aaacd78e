"""Fixed-bucket histograms the core updates on its hot paths and metrics read later.

An OpenTelemetry `Histogram.record` costs microseconds (attribute lookup, a lock, its
own bucket search) and would run once per delivered message; this costs one C-level
bisect and two additions, and the exporter turns the counts into histogram points
only when a reader collects (see `fila.telemetry.metrics`). Minimum and maximum are
not tracked (two more comparisons per sample; OTLP makes them optional and Prometheus
has no use for them). Writers are on one thread (the event loop, or the fsync thread
for fsync durations); readers copy the counts from another, which can at worst see
one sample counted in `counts` but not yet in `total`: harmless for monitoring, and
no lock on the hot path.

Bucket i counts values in (bounds[i-1], bounds[i]], as OpenTelemetry explicit-bucket
histograms do; the last bucket counts everything above the last bound.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

# Enqueue-to-delivery latency, in milliseconds: from "as fast as the disk" to an hour
# of backlog, roughly 1-2.5-5 per decade.
DELIVERY_LATENCY_BOUNDS_MS: tuple[int, ...] = (
    1, 2, 5, 10, 25, 50, 100, 250, 500,
    1_000, 2_500, 5_000, 10_000, 30_000, 60_000, 300_000, 900_000, 3_600_000,
)  # fmt: skip

# One fsync of the write-ahead log, in seconds: about 0.2 ms on a good local SSD,
# tens of milliseconds on network or throttled disks, seconds when a disk is failing.
FSYNC_BOUNDS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


# How late the event loop ran a callback, in seconds (`fila.telemetry.loop_lag`): under
# a millisecond when it keeps up, tens of milliseconds when busy, seconds when one call
# holds it.
LOOP_LAG_BOUNDS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class FixedHistogram:
    """Counts of values per bucket, and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total: float = 0

    def record(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def snapshot(self) -> HistogramSnapshot:
        """A consistent-enough copy for a reader on another thread (see the module doc)."""
        counts = list(self.counts)
        return HistogramSnapshot(self.bounds, counts, sum(counts), self.total)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    bounds: tuple[float, ...]
    counts: list[int]
    count: int
    total: float
