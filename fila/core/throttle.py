"""Token buckets for throttle keys, driven by `throttle.<key>` runtime config.

A message may name several throttle keys; it is deliverable only when every
key that has a bucket holds a whole token, and delivery takes one from each.
Keys without a bucket are unlimited. Buckets refill lazily, when looked at, so
an idle bucket costs nothing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from fila.clock import Clock

THROTTLE_PREFIX = "throttle."
# A slower rate would hold a key back for hours per token; a faster one is no limit.
MIN_RATE = 0.001
MAX_RATE = 1e9
MAX_BURST = 1e9
# Refusals are counted per throttle key (fila.throttle.limited) for at most this many
# keys; refusals of keys beyond it are counted under OTHER_KEYS, so a million tenants
# cannot make a million metric series.
MAX_COUNTED_KEYS = 1000
# A token is whole a hair below 1.0: elapsed * rate in floating point can land just
# under a whole token at the very moment it is due, and waiting another tick for it
# would pace every token of a burst-1 bucket a tick late.
_WHOLE_TOKEN = 1.0 - 1e-9
_NS = 1e9
OTHER_KEYS = "other"


class TokenBucket:
    """Tokens refilled by elapsed time, counted in whole nanoseconds (`Clock.now_ns`): a
    difference of seconds-since-1970 floats is off by up to a few tenths of a
    microsecond, enough to leave a token just short when it is due."""

    __slots__ = ("burst", "rate", "tokens", "updated_ns")

    def __init__(self, rate: float, burst: float, now_ns: int) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.updated_ns = now_ns

    def refill(self, now_ns: int) -> float:
        elapsed = now_ns - self.updated_ns
        if elapsed > 0:
            self.tokens = min(self.burst, self.tokens + elapsed * self.rate / _NS)
            self.updated_ns = now_ns
        return self.tokens


@dataclass(frozen=True, slots=True)
class ThrottleStats:
    key: str
    tokens: float
    rate_per_second: float
    burst: float


# A plain decimal number, as an operator writes one: 20, 0.5, .5, 1e3.
_DECIMAL = re.compile(r"\s*\+?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def parse_throttle_value(value: str) -> tuple[float, float]:
    """Parses ``"<rate>,<burst>"``; raises ValueError with a reason a user can act on."""
    parts = value.split(",")
    if len(parts) != 2:
        raise ValueError(f'expected "<rate>,<burst>", got "{value[:80]}"')
    if not all(_DECIMAL.fullmatch(part) for part in parts):
        # float() alone would also take "1_0", "nan" and "inf"
        raise ValueError(f'rate and burst must be decimal numbers, got "{value[:80]}"')
    rate, burst = float(parts[0]), float(parts[1])
    if not (math.isfinite(rate) and MIN_RATE <= rate <= MAX_RATE):
        raise ValueError(
            f"rate must be from {MIN_RATE:g} to {MAX_RATE:g} tokens per second, "
            f"got {parts[0].strip()[:40]}"
        )
    if not (math.isfinite(burst) and 1 <= burst <= MAX_BURST):
        raise ValueError(f"burst must be from 1 to {MAX_BURST:g}, got {parts[1].strip()[:40]}")
    return rate, burst


class Throttles:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        # Deliveries held back for lack of a token, by the key that lacked it.
        self.limited: dict[str, int] = {}

    def configure(self, key: str, rate: float, burst: float) -> None:
        """Creates a full bucket, or retunes an existing one keeping its tokens (capped)."""
        now = self._clock.now_ns()
        bucket = self._buckets.get(key)
        if bucket is None:
            self._buckets[key] = TokenBucket(rate, burst, now)
            return
        bucket.refill(now)
        bucket.rate = rate
        bucket.burst = burst
        bucket.tokens = min(bucket.tokens, burst)

    @property
    def active(self) -> bool:
        return bool(self._buckets)

    def remove(self, key: str) -> None:
        self._buckets.pop(key, None)

    def try_take(self, keys: tuple[str, ...]) -> bool:
        """Takes one token from each bucketed key, or none if any lacks one."""
        buckets = self._buckets
        if not buckets:
            return True
        now = self._clock.now_ns()
        found: list[TokenBucket] = []
        for key in keys:
            bucket = buckets.get(key)
            if bucket is None:
                continue
            if bucket.refill(now) < _WHOLE_TOKEN:
                self._count_limited(key)
                return False
            found.append(bucket)
        for bucket in found:
            bucket.tokens -= 1.0
        return True

    def _count_limited(self, key: str) -> None:
        limited = self.limited
        if key not in limited and len(limited) >= MAX_COUNTED_KEYS:
            key = OTHER_KEYS
        limited[key] = limited.get(key, 0) + 1

    def seconds_until_available(self, keys: Iterable[str]) -> float:
        """How long until every bucketed key in `keys` holds a whole token."""
        now = self._clock.now_ns()
        wait = 0.0
        for key in keys:
            bucket = self._buckets.get(key)
            if bucket is None:
                continue
            missing = _WHOLE_TOKEN - bucket.refill(now)
            if missing > 0:
                wait = max(wait, missing / bucket.rate)
        return wait

    def stats(self, keys: set[str] | None = None) -> list[ThrottleStats]:
        """Every bucket, or those of `keys`, by key."""
        now = self._clock.now_ns()
        buckets = self._buckets
        names = sorted(buckets if keys is None else keys & buckets.keys())
        return [
            ThrottleStats(key, buckets[key].refill(now), buckets[key].rate, buckets[key].burst)
            for key in names
        ]
