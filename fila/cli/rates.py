"""Per-second rates from the broker's counters, taken from two samples.

GetStats reports counters since the broker started (`enqueued_total`, ...; per
fairness key `delivered_total`); the difference between two samples over the time
between them is a rate, with no metrics system involved. A counter that went down
means the broker restarted (its counters start again at 0): that interval has no
rate rather than a negative one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from fila_sdk import QueueStats

# The GetStats counters, by the name shown (the field is `<name>_total`).
COUNTERS: Final = ("enqueued", "delivered", "acked", "nacked", "expired", "dead_lettered")


@dataclass(frozen=True, slots=True)
class Sample:
    """A queue's stats and the monotonic time they were read."""

    at: float
    stats: QueueStats


@dataclass(frozen=True, slots=True)
class Rates:
    """Per-second rates; None where there is no earlier sample to compare with."""

    counters: dict[str, float | None] = field(default_factory=dict)
    # deliveries per second of each fairness key present in both samples
    per_key: dict[str, float | None] = field(default_factory=dict)

    def share(self, key: str) -> float | None:
        """`key`'s fraction of the queue's deliveries over the interval."""
        mine, total = self.per_key.get(key), self.counters.get("delivered")
        if mine is None or not total:
            return None
        return mine / total


def per_second(earlier: int, later: int, seconds: float) -> float | None:
    if seconds <= 0 or later < earlier:
        return None
    return (later - earlier) / seconds


def rates(previous: Sample | None, current: Sample) -> Rates:
    if previous is None:
        return Rates(dict.fromkeys(COUNTERS), dict.fromkeys(k.key for k in current.stats.per_key))
    seconds = current.at - previous.at
    before, now = previous.stats, current.stats
    counters = {
        name: per_second(getattr(before, f"{name}_total"), getattr(now, f"{name}_total"), seconds)
        for name in COUNTERS
    }
    earlier_keys = {k.key: k.delivered_total for k in before.per_key}
    per_key = {
        k.key: (
            per_second(earlier_keys[k.key], k.delivered_total, seconds)
            if k.key in earlier_keys
            else None
        )
        for k in now.per_key
    }
    return Rates(counters, per_key)
