"""Read-only views of broker state returned by stats calls, and lifetime counters."""

from __future__ import annotations

from dataclasses import dataclass

from fila.core.throttle import ThrottleStats


@dataclass(frozen=True, slots=True)
class KeyStats:
    key: str
    pending: int
    deficit: int
    weight: int


@dataclass(frozen=True, slots=True)
class QueueStats:
    depth: int
    in_flight: int
    active_fairness_keys: int
    active_consumers: int
    quantum: int
    per_key: list[KeyStats]
    per_throttle: list[ThrottleStats]


@dataclass(slots=True)
class BrokerCounters:
    """Monotonic event counts since start; exported as metrics."""

    enqueued: int = 0
    delivered: int = 0
    acked: int = 0
    nacked: int = 0
    expired: int = 0
    dead_lettered: int = 0
    redriven: int = 0
