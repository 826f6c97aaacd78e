"""What the dashboard remembers about each queue, and the rates and shares derived from it.

The broker reports counters since it started (`enqueued_total`, per-key
`delivered_total`, ...), not rates: a rate is the difference of two samples over
the time between them, so the dashboard keeps a few minutes of samples in memory.
No metrics system is needed, and nothing survives a dashboard restart (by design:
the broker is the source of truth).

Counters restart from zero when the broker restarts. A counter that went down
marks a restart: no rate is computed across it, so a restart shows as a gap, never
as a huge negative or positive spike.

All times are `time.monotonic()` seconds; pure functions of the samples, so tests
can feed samples with made-up times.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

# Rates shown as numbers are averaged over this many seconds of samples: long enough
# to smooth a bursty producer, short enough to follow a change within a few refreshes.
RATE_WINDOW_S: Final = 10.0
# Each key's share of deliveries is measured over this window. Per-key stats older
# than it are dropped from the kept samples: with up to 1,000 listed keys per queue,
# keeping them for the whole chart history would cost far more memory than it shows.
SHARE_WINDOW_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class Counters:
    """The broker's monotonic per-queue counters at one instant."""

    enqueued: int
    delivered: int
    acked: int
    nacked: int
    expired: int
    dead_lettered: int

    def went_back(self, earlier: Counters) -> bool:
        """True when any counter decreased: the broker restarted in between."""
        return (
            self.enqueued < earlier.enqueued
            or self.delivered < earlier.delivered
            or self.acked < earlier.acked
            or self.nacked < earlier.nacked
            or self.expired < earlier.expired
            or self.dead_lettered < earlier.dead_lettered
        )


@dataclass(frozen=True, slots=True)
class KeyStat:
    key: str
    pending: int
    deficit: int
    weight: int
    delivered_total: int


@dataclass(frozen=True, slots=True)
class ThrottleStat:
    key: str
    tokens: float
    rate_per_second: float
    burst: float


@dataclass(frozen=True, slots=True)
class QueueSample:
    """One observation of one queue. `counters` is None when GetStats failed or was denied."""

    at: float
    depth: int
    in_flight: int
    consumers: int
    counters: Counters | None
    keys: tuple[KeyStat, ...] = ()
    throttles: tuple[ThrottleStat, ...] = ()
    quantum: int = 0
    active_keys: int = 0
    stats_error: str = ""
    # Of `depth`, the messages waiting out a delay (the rest are ready); `in_flight`
    # are the leased ones.
    delayed: int = 0
    # Lua hook failures at run time since the broker started, and the latest one.
    hook_errors: int = 0
    last_hook_error: str = ""
    last_hook_error_at_ms: int = 0
    # Cluster mode: the node leading the queue (0 on a single node) and, when it is
    # replicated, its replicas (leader first) and in-sync set.
    leader: int = 0
    replicas: tuple[int, ...] = ()
    in_sync: tuple[int, ...] = ()

    @property
    def ready(self) -> int:
        return max(0, self.depth - self.delayed)

    @property
    def followers(self) -> list[tuple[int, bool]]:
        """A replicated queue's followers, each with whether it is in sync."""
        return [(node, node in self.in_sync) for node in self.replicas if node != self.leader]


@dataclass(frozen=True, slots=True)
class Rates:
    """Events per second over `span` seconds."""

    enqueued: float
    delivered: float
    acked: float
    span: float


@dataclass(frozen=True, slots=True)
class RatePoint:
    """Rates between two consecutive samples, placed at the later one."""

    at: float
    enqueued: float
    delivered: float
    acked: float


@dataclass(frozen=True, slots=True)
class KeyShare:
    """A fairness key with its share of recent deliveries next to its share of the weights.

    `weight_share` is None for a key that is not backlogged now: DRR's promise (share
    proportional to weight) is among the keys that have messages ready.
    """

    key: str
    pending: int
    deficit: int
    weight: int
    active: bool
    delivered_recent: int
    delivery_share: float | None
    weight_share: float | None


def rate_between(earlier: QueueSample, later: QueueSample) -> Rates | None:
    a, b = earlier.counters, later.counters
    span = later.at - earlier.at
    if a is None or b is None or span <= 0 or b.went_back(a):
        return None
    return Rates(
        enqueued=(b.enqueued - a.enqueued) / span,
        delivered=(b.delivered - a.delivered) / span,
        acked=(b.acked - a.acked) / span,
        span=span,
    )


class QueueHistory:
    """The samples of one queue for the last `retention` seconds (oldest first).

    Only the samples of the last `key_window` seconds keep their per-key and
    per-throttle stats and the last hook error's text; older ones keep
    the queue's own numbers for the charts.
    """

    def __init__(self, retention: float, key_window: float = SHARE_WINDOW_S) -> None:
        self.retention = retention
        self.key_window = key_window
        self.samples: deque[QueueSample] = deque()
        self._bare = 0  # how many of the oldest samples have had their keys dropped

    def add(self, sample: QueueSample) -> None:
        self.samples.append(sample)
        horizon = sample.at - self.retention
        while self.samples and self.samples[0].at < horizon:
            self.samples.popleft()
            self._bare = max(0, self._bare - 1)
        key_horizon = sample.at - self.key_window
        while self._bare < len(self.samples) and self.samples[self._bare].at < key_horizon:
            old = self.samples[self._bare]
            if old.keys or old.throttles or old.last_hook_error:
                self.samples[self._bare] = replace(old, keys=(), throttles=(), last_hook_error="")
            self._bare += 1

    @property
    def latest(self) -> QueueSample | None:
        return self.samples[-1] if self.samples else None

    def recent(self, window: float) -> list[QueueSample]:
        """Samples of the last `window` seconds, after the last broker restart in it."""
        if not self.samples:
            return []
        horizon = self.samples[-1].at - window
        picked: list[QueueSample] = []
        for sample in reversed(self.samples):
            if sample.at < horizon:
                break
            if picked and _restart_between(sample, picked[-1]):
                break
            picked.append(sample)
        picked.reverse()
        return picked

    def rates(self, window: float) -> Rates | None:
        """Average rates over the last `window` seconds (None until two samples exist)."""
        with_counters = [s for s in self.recent(window) if s.counters is not None]
        if len(with_counters) < 2:
            return None
        return rate_between(with_counters[0], with_counters[-1])

    def rate_series(self) -> list[RatePoint]:
        points: list[RatePoint] = []
        samples = list(self.samples)
        for earlier, later in itertools.pairwise(samples):
            rates = rate_between(earlier, later)
            if rates is not None:
                points.append(RatePoint(later.at, rates.enqueued, rates.delivered, rates.acked))
        return points

    def key_shares(self, window: float) -> list[KeyShare]:
        return key_shares(self.recent(window))


def _restart_between(earlier: QueueSample, later: QueueSample) -> bool:
    return (
        earlier.counters is not None
        and later.counters is not None
        and later.counters.went_back(earlier.counters)
    )


def key_shares(samples: Sequence[QueueSample]) -> list[KeyShare]:
    """Each key's deliveries over `samples` (oldest first, no restart among them).

    The broker lists a key only while it has messages ready, so a key's deliveries are
    counted from the first sample that lists it to the last one: a key that became
    active mid-window loses at most one sampling interval of deliveries.
    """
    if not samples:
        return []
    first: dict[str, int] = {}
    last: dict[str, KeyStat] = {}
    for sample in samples:
        for stat in sample.keys:
            first.setdefault(stat.key, stat.delivered_total)
            last[stat.key] = stat
    current = {stat.key: stat for stat in samples[-1].keys}
    delivered = {key: max(0, last[key].delivered_total - first[key]) for key in last}
    total_delivered = sum(delivered.values())
    total_weight = sum(stat.weight for stat in current.values())
    shares: list[KeyShare] = []
    for key in sorted(last):
        stat = current.get(key, last[key])
        active = key in current
        shares.append(
            KeyShare(
                key=key,
                pending=stat.pending if active else 0,
                deficit=stat.deficit if active else 0,
                weight=stat.weight,
                active=active,
                delivered_recent=delivered[key],
                delivery_share=delivered[key] / total_delivered if total_delivered else None,
                weight_share=stat.weight / total_weight if active and total_weight else None,
            )
        )
    return [s for s in shares if s.active or s.delivered_recent]
