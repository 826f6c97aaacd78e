"""Lua `print` output: marked, escaped, truncated and rate limited.

Written straight to the broker's stdout, a looping `print` filled hundreds of
megabytes in a few enqueues (docs/benchmarks.md, "Measurements behind design
choices"), and a script could write lines that look like the broker's own
(`level=CRITICAL ...`). Now each `print` call becomes at most one INFO line on the
`fila.lua` logger:

    lua print queue="orders" hook=on_enqueue text="tenant=acme\\nweight=3"

The text is JSON-quoted (newlines and control characters escaped, so it can never
start a line of its own) and cut to 512 bytes by the sandbox. Each queue may log
10 lines a second with bursts of 20, and all queues together 100 a second; lines over
the rate are dropped and counted, and the next line that gets through says how many
were dropped.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("fila.lua")

PRINT_MAX_BYTES = 512


@dataclass(slots=True)
class _Bucket:
    rate: float
    burst: float
    tokens: float
    updated: float

    def take(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


def _bucket(rate: float, burst: float) -> _Bucket:
    return _Bucket(rate, burst, burst, time.monotonic())


_ALL_QUEUES = _bucket(100.0, 200.0)


class ScriptLog:
    """The `print` of one queue's scripts."""

    def __init__(self, queue: str, rate: float = 10.0, burst: float = 20.0) -> None:
        self._queue = queue
        self._bucket = _bucket(rate, burst)
        self.dropped = 0

    def emit(self, hook: bytes, text: bytes) -> None:
        """Called from Lua; must not raise (it runs inside the script's call)."""
        now = time.monotonic()
        if not (self._bucket.take(now) and _ALL_QUEUES.take(now)):
            self.dropped += 1
            return
        # fields, which the log formatter quotes and escapes: the text cannot forge a line
        fields = {
            "queue": self._queue,
            "hook": hook.decode("ascii", "replace"),
            "text": text[:PRINT_MAX_BYTES].decode("utf-8", "replace"),
            "dropped_before": self.dropped or None,
        }
        self.dropped = 0
        log.info("lua print", extra=fields)
