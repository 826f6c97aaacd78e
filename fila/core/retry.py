"""A queue's retry policy without Lua: how many attempts, and how long between them.

Used when a queue has no `on_failure` hook (a hook, when present, decides instead).
After a failed attempt (a nack or an expired lease) the message waits on the backoff
curve and is dead-lettered once it has failed `max_attempts` times in all:

- `exponential` (the default): about `1s * 2^(attempt-1)`, each wait drawn within
  +-25% of that so that a burst of failures does not come back as one burst, and
  never more than 1 h (Sidekiq's and BullMQ's shape);
- `none`: ready again at once (what every queue did before retry policies);
- `fixed:<duration>`: the same wait every time, e.g. `fixed:30s` (see `fila.durations`).

On the wire `max_attempts` 0 means the broker default (25) and `UNLIMITED` (2^32-1)
no limit; a stored record keeps 0 for no limit, which is also what a record written
before retry policies existed reads as, with `none`: such queues go on as they did.

The random draw is injected (`Backoff.delay_ms(attempt, random)`), so in-process tests
pin it and check the curve's bounds exactly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from fila.core.errors import InvalidArgument, clip
from fila.durations import format_ms, parse_ms
from fila.lua.hooks import DEFAULT_FAILURE, FailureDecision
from fila.wire import UNLIMITED_ATTEMPTS

DEFAULT_MAX_ATTEMPTS: Final = 25
# The wire's "no limit" (QueueConfig.max_attempts is a uint32; 0 is "the default").
UNLIMITED: Final = UNLIMITED_ATTEMPTS
EXPONENTIAL: Final = "exponential"
NONE: Final = "none"
FIXED_PREFIX: Final = "fixed:"
BASE_MS: Final = 1_000
CAP_MS: Final = 3_600_000
JITTER: Final = 0.25
# The longest fixed wait: a message's delay is bounded the same way (366 days).
MAX_FIXED_MS: Final = 366 * 24 * 3600 * 1000

Random = Callable[[], float]  # uniform in [0, 1), as random.random


@dataclass(frozen=True, slots=True)
class Backoff:
    """A parsed `retry_backoff`: `kind` is exponential, none or fixed (`fixed_ms`)."""

    kind: str
    fixed_ms: int = 0

    @classmethod
    def parse(cls, text: str) -> Backoff:
        """`text` as given on the wire ("" = exponential); INVALID_ARGUMENT otherwise."""
        spec = text.strip().lower()
        if spec in ("", EXPONENTIAL):
            return cls(EXPONENTIAL)
        if spec == NONE:
            return cls(NONE)
        if spec.startswith(FIXED_PREFIX):
            try:
                ms = parse_ms(spec[len(FIXED_PREFIX) :])
            except ValueError as err:
                raise InvalidArgument(f"retry_backoff: {err}") from None
            if not 0 < ms <= MAX_FIXED_MS:
                raise InvalidArgument(
                    f'retry_backoff "{clip(text)}": a fixed wait is from 1ms to 366d'
                )
            return cls("fixed", ms)
        raise InvalidArgument(
            f'retry_backoff "{clip(text)}" is not "exponential", "none" or "fixed:<duration>" '
            '(e.g. "fixed:30s")'
        )

    def __str__(self) -> str:
        return f"{FIXED_PREFIX}{format_ms(self.fixed_ms)}" if self.kind == "fixed" else self.kind

    def delay_ms(self, attempt: int, random: Random) -> int:
        """The wait after failed attempt number `attempt` (1 for the first failure)."""
        if self.kind == NONE:
            return 0
        if self.kind == "fixed":
            return self.fixed_ms
        nominal = BASE_MS * 2.0 ** min(attempt - 1, 32)
        jittered = nominal * (1.0 - JITTER + 2.0 * JITTER * random())
        return min(int(jittered), CAP_MS)


def stored_max_attempts(wire: int) -> int:
    """A QueueConfig.max_attempts as the record keeps it (0: no limit)."""
    if wire == 0:
        return DEFAULT_MAX_ATTEMPTS
    return 0 if wire == UNLIMITED else wire


def wire_max_attempts(stored: int) -> int:
    """A record's max_attempts as GetQueue answers it (UNLIMITED for no limit)."""
    return stored or UNLIMITED


def exhausted(attempts: int, max_attempts: int) -> bool:
    """Whether a message that has now failed `attempts` times goes to the DLQ."""
    return bool(max_attempts) and attempts >= max_attempts


def policy_decision(
    max_attempts: int, backoff_text: str, attempts: int, random: Random, *, wait: bool
) -> FailureDecision:
    """What a queue without an `on_failure` hook does with a message that has now failed
    `attempts` times: dead-letter it once `max_attempts` is reached, else retry it after
    the backoff (at once when not `wait`: a consumer stream that ended)."""
    if exhausted(attempts, max_attempts):
        return DEAD_LETTER
    if not wait:
        return DEFAULT_FAILURE
    delay = backoff_of(backoff_text).delay_ms(attempts, random)
    return FailureDecision("retry", delay) if delay else DEFAULT_FAILURE


@functools.lru_cache(maxsize=256)
def backoff_of(text: str) -> Backoff:
    """A stored `retry_backoff` parsed (stored values were validated; a bad one, from
    damage, retries at once)."""
    try:
        return Backoff.parse(text)
    except InvalidArgument:
        return Backoff(NONE)


DEAD_LETTER: Final = FailureDecision("dlq")
