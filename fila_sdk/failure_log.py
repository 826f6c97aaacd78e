"""The WARNING lines a `Worker` writes when a handler raises, rate limited.

Every failure is nacked (the broker's retry policy or `on_failure` hook decides what
follows), and a failing handler should be visible without turning on DEBUG. But a
handler that always raises can fail thousands of times a second on a queue that
retries at once, so lines come in bursts of `BURST` and then `RATE` a second; the
lines dropped in between are counted on the next one that is written
(`dropped_before`), so the log still says how often the handler fails.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

BURST: Final = 10.0
RATE: Final = 1.0


class FailureLog:
    """Rate-limited handler failure lines of one worker."""

    __slots__ = ("_clock", "_log", "_queue", "_stamp", "_tokens", "dropped")

    def __init__(
        self, log: logging.Logger, queue: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = log
        self._queue = queue
        self._clock = clock
        self._tokens = BURST
        self._stamp = clock()
        self.dropped = 0

    def failed(self, message_id: str, attempt: int, error: BaseException) -> None:
        """One handler failure: `attempt` counts from 1 (the first delivery)."""
        now = self._clock()
        self._tokens = min(BURST, self._tokens + (now - self._stamp) * RATE)
        self._stamp = now
        if self._tokens < 1.0:
            self.dropped += 1
            return
        self._tokens -= 1.0
        dropped, self.dropped = self.dropped, 0
        more = f" ({dropped} more failures not logged since the last line)" if dropped else ""
        self._log.warning(
            "worker on %r: handler failed for message %s (attempt %d): %s: %s%s",
            self._queue,
            message_id,
            attempt,
            type(error).__name__,
            error,
            more,
            exc_info=error,
            extra={
                "queue": self._queue,
                "message_id": message_id,
                "attempt": attempt,
                "dropped_before": dropped or None,
            },
        )
