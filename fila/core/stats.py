"""Counters the broker keeps, and the read-only views stats calls return."""

from __future__ import annotations

from dataclasses import dataclass

from fila.core.throttle import ThrottleStats

# Per-key delivery counts are kept for at most this many keys per queue (the
# dashboard's and watch mode's share-of-deliveries view); deliveries to keys beyond
# it are still counted in the queue's total.
MAX_TRACKED_KEYS = 10_000


@dataclass(slots=True)
class QueueCounters:
    """Monotonic event counts of one queue since the broker started."""

    enqueued: int = 0
    delivered: int = 0
    acked: int = 0
    nacked: int = 0
    expired: int = 0
    dead_lettered: int = 0
    redriven: int = 0
    purged: int = 0
    throttled: int = 0


@dataclass(frozen=True, slots=True)
class KeyStats:
    key: str
    pending: int
    deficit: int
    weight: int
    delivered: int


@dataclass(frozen=True, slots=True)
class QueueStats:
    depth: int  # ready + delayed (leased messages are in_flight)
    delayed: int
    # run-time failures of the queue's hooks since the broker started (or the hooks
    # last changed), the last one's text and time (0: none)
    hook_errors_total: int
    last_hook_error: str
    last_hook_error_at_ms: int
    in_flight: int
    active_fairness_keys: int
    active_consumers: int
    quantum: int
    per_key: list[KeyStats]
    per_throttle: list[ThrottleStats]
    counters: QueueCounters
