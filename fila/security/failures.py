"""Failed authentication: log it without flooding, and slow down peers that keep failing.

Why delay the refusal rather than answer it faster: a client guessing keys waits
for each answer before sending the next guess, one or a few in flight. Holding a
persistent failer's answers for up to `MAX_DELAY_S` caps its rate at (calls in
flight / delay) at no cost to the event loop, since a held call is a sleeping
coroutine. Without it, a flood of wrong keys is answered as fast as the broker can,
and a legitimate client's latency during it rises many times over; held back, the
same attack is spread over many seconds, and the legitimate client's latency stays
within its quiet-time spread (measured with `scripts/auth_flood.py`; figures:
docs/benchmarks.md, "Measurements behind design choices").

Only failing calls are delayed, never calls with a valid key, so a legitimate
client behind the same address (a NAT, or loopback) keeps full speed; that is
why peers are counted by host, not by connection, and a guesser gains nothing
by reconnecting.

Score per peer host: +1 per failure, leaking `LEAK_PER_S` per second. The first
`FREE_FAILURES` are answered at once, so a misconfigured client gets its error
quickly; after that the delay doubles from `BASE_DELAY_S` up to `MAX_DELAY_S`,
less a random part of up to `JITTER` of it: without it, a guesser's calls held
together come due together, and their refusals and its next guesses would reach
the event loop in one burst (observed as a stall of the loop each second).
At most `MAX_HELD` calls are held at a time and at most `MAX_PEERS` hosts are
tracked (least recently failing dropped first), so memory stays bounded; past
either bound a failure is answered at once.

Log lines share one token bucket (`LOG_BURST`, then `LOG_PER_S` a second); each
line says how many failures went unlogged since the previous one.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

FREE_FAILURES: Final = 5
LEAK_PER_S: Final = 1.0
BASE_DELAY_S: Final = 0.05
MAX_DELAY_S: Final = 1.0
JITTER: Final = 0.5
MAX_HELD: Final = 2_000
MAX_PEERS: Final = 10_000
LOG_BURST: Final = 10
LOG_PER_S: Final = 1.0
_MAX_DOUBLINGS: Final = 16


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with one failed attempt. A non-zero delay must be followed by
    `FailureGuard.released()` once the call stops waiting."""

    delay_s: float
    log: bool
    unlogged_before: int


class FailureGuard:
    def __init__(
        self,
        now: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self._now = now
        self._jitter = jitter  # uniform in [0, 1)
        # peer -> (score, time of the last failure); ordered least recently failing first.
        self._scores: dict[str, tuple[float, float]] = {}
        self._held = 0
        self._log_tokens = float(LOG_BURST)
        self._log_at = now()
        self._unlogged = 0

    @property
    def held(self) -> int:
        return self._held

    def failed(self, peer: str) -> Verdict:
        now = self._now()
        previous = self._scores.pop(peer, None)
        score = 1.0
        if previous is not None:
            score += max(0.0, previous[0] - (now - previous[1]) * LEAK_PER_S)
        self._scores[peer] = (score, now)
        while len(self._scores) > MAX_PEERS:
            del self._scores[next(iter(self._scores))]
        delay_s = 0.0
        if score > FREE_FAILURES and self._held < MAX_HELD:
            doublings = min(score - FREE_FAILURES - 1, _MAX_DOUBLINGS)
            delay_s = min(MAX_DELAY_S, BASE_DELAY_S * 2**doublings)
            delay_s *= 1.0 - JITTER * self._jitter()
            self._held += 1
        if self._take_log_token(now):
            unlogged, self._unlogged = self._unlogged, 0
            return Verdict(delay_s, True, unlogged)
        self._unlogged += 1
        return Verdict(delay_s, False, 0)

    def released(self) -> None:
        self._held -= 1

    def _take_log_token(self, now: float) -> bool:
        self._log_tokens = min(LOG_BURST, self._log_tokens + (now - self._log_at) * LOG_PER_S)
        self._log_at = now
        if self._log_tokens >= 1.0:
            self._log_tokens -= 1.0
            return True
        return False
