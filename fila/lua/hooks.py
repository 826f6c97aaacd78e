"""A queue's `on_enqueue` and `on_failure` hooks, with fallback and circuit breaker.

A hook that errors, runs out of budget or memory, or returns anything but a valid
decision (wrong shape, invalid UTF-8, NUL bytes, ...) must not fail the request: the
message gets the default decision and the failure is counted. `on_enqueue` and
`on_failure` never raise, whatever the script does: the core calls them in the middle
of changing a message's state, and an exception there would leave the message half
moved. After `threshold` consecutive failures the hook is bypassed for `cooldown`, so
a broken script costs at most a few budgets per cooldown instead of one per message.

A hook that fails for some messages only (a header some producers send) never opens
the breaker, since each success resets it; its failures are logged through
`FailureLog`, rate limited per queue, because the error text is the script's and may
be the producer's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from fila.clock import Clock
from fila.lua.sandbox import LuaSandbox, Outcome, ScriptError
from fila.lua.script_log import ScriptLog, _Bucket
from fila.lua.static_check import check_globals

log = logging.getLogger("fila.lua")

ON_ENQUEUE = "on_enqueue"
ON_FAILURE = "on_failure"


@dataclass(frozen=True, slots=True)
class LuaLimits:
    timeout_ms: int
    memory_limit_bytes: int
    breaker_threshold: int
    breaker_cooldown_ms: int


@dataclass(frozen=True, slots=True)
class EnqueueDecision:
    fairness_key: str = "default"
    weight: int = 1
    throttle_keys: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class FailureDecision:
    action: Literal["retry", "dlq"] = "retry"
    delay_ms: int = 0


DEFAULT_ENQUEUE = EnqueueDecision()
DEFAULT_FAILURE = FailureDecision()


@dataclass(slots=True)
class HookCounters:
    """Outcome counts, read by stats and metrics."""

    ok: int = 0
    failed: int = 0
    bypassed: int = 0
    last_error: str = ""
    last_error_at_ms: int = 0  # on the broker's clock; 0 = never


@dataclass(slots=True)
class _Breaker:
    threshold: int
    cooldown_ms: int
    consecutive_failures: int = 0
    open_until_ms: int = 0

    def is_open(self, now_ms: int) -> bool:
        return now_ms < self.open_until_ms

    def record(self, ok: bool, now_ms: int) -> None:
        if ok:
            self.consecutive_failures = 0
            return
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.threshold:
            self.open_until_ms = now_ms + self.cooldown_ms
            self.consecutive_failures = 0


@dataclass(slots=True)
class _Hook:
    name: str
    breaker: _Breaker
    counters: HookCounters = field(default_factory=HookCounters)


# how much of a failure's text is kept in HookCounters.last_error and logged
ERROR_TEXT_MAX = 500


# Hook failure lines: per queue, bursts of FAILURE_LOG_BURST then one a second; all
# queues together FAILURE_LOG_TOTAL_RATE a second (bursts of FAILURE_LOG_TOTAL_BURST).
FAILURE_LOG_BURST = 10.0
FAILURE_LOG_RATE = 1.0
FAILURE_LOG_TOTAL_BURST = 50.0
FAILURE_LOG_TOTAL_RATE = 20.0
_ALL_FAILURES = _Bucket(
    FAILURE_LOG_TOTAL_RATE, FAILURE_LOG_TOTAL_BURST, FAILURE_LOG_TOTAL_BURST, time.monotonic()
)


class FailureLog:
    """The WARNING lines of one queue's hook failures, rate limited like Lua `print`.

    Unlimited, a hook failing for every second message logged a line per failure,
    each with up to `ERROR_TEXT_MAX` characters of the script's error text (which a
    producer can choose through headers), so one client could flood the log
    (figures: docs/benchmarks.md, "Measurements behind design choices"). Lines
    over the rate are dropped and counted; the next line that gets through carries the
    count (`dropped_before`), so an operator still learns that, and how often, the hook
    fails. `fila_lua_executions_total{outcome="failed"}` counts every failure.
    """

    def __init__(self, queue: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._queue = queue
        self._clock = clock
        self._bucket = _Bucket(FAILURE_LOG_RATE, FAILURE_LOG_BURST, FAILURE_LOG_BURST, clock())
        self.dropped = 0

    def failed(self, hook: str, text: str) -> None:
        now = self._clock()
        if not self._bucket.take(now) or not _ALL_FAILURES.take(time.monotonic()):
            self.dropped += 1
            return
        dropped, self.dropped = self.dropped, 0
        # fields, not words in the message: the log formatter quotes and escapes each
        # value, so a script's error text cannot forge a line or a field
        log.warning(
            "lua hook failed",
            extra={
                "queue": self._queue,
                "hook": hook,
                "error": text,
                "dropped_before": dropped or None,
            },
        )


def validate_scripts(on_enqueue: str, on_failure: str, limits: LuaLimits) -> None:
    """Raises ScriptError if either script would be refused at queue creation."""
    QueueHooks(
        "validation", on_enqueue, on_failure, limits, lambda _key: None, _NO_CLOCK, strict=True
    )


class _NoClock:
    def now_ms(self) -> int:
        return 0

    def now_ns(self) -> int:
        return 0


_NO_CLOCK = _NoClock()


class QueueHooks:
    def __init__(
        self,
        queue: str,
        on_enqueue: str,
        on_failure: str,
        limits: LuaLimits,
        config_get: Callable[[str], str | None],
        clock: Clock,
        *,
        strict: bool = False,
    ) -> None:
        """`strict` (creation and update, not recovery): also refuse a script that calls
        what the sandbox lacks (`fila.lua.static_check`)."""
        self._queue = queue
        self._strict = strict
        self._clock = clock
        self._failure_log = FailureLog(queue)
        self._sandbox = LuaSandbox(
            queue=queue,
            timeout_ms=limits.timeout_ms,
            memory_limit_bytes=limits.memory_limit_bytes,
            config_get=config_get,
            script_log=ScriptLog(queue),
        )
        self._enqueue_hook = self._load(on_enqueue, ON_ENQUEUE, limits)
        self._failure_hook = self._load(on_failure, ON_FAILURE, limits)

    @property
    def has_on_enqueue(self) -> bool:
        return self._enqueue_hook is not None

    @property
    def has_on_failure(self) -> bool:
        return self._failure_hook is not None

    def counters(self) -> dict[str, HookCounters]:
        hooks = {ON_ENQUEUE: self._enqueue_hook, ON_FAILURE: self._failure_hook}
        return {name: hook.counters for name, hook in hooks.items() if hook is not None}

    def on_enqueue(self, headers: Mapping[str, str], payload_size: int) -> EnqueueDecision:
        hook = self._enqueue_hook
        if hook is None or self._bypassed(hook):
            return DEFAULT_ENQUEUE
        try:
            outcome = self._sandbox.on_enqueue(headers, payload_size)
            if outcome[0] is True:
                _, key, weight, throttle_keys = outcome
                decision = EnqueueDecision(key, weight, throttle_keys)
            else:
                decision = None
        except Exception as exc:  # any failure becomes a fallback: see _unforeseen
            outcome, decision = _unforeseen(exc), None
        self._record(hook, outcome)
        return DEFAULT_ENQUEUE if decision is None else decision

    def on_failure(
        self, message_id: str, headers: Mapping[str, str], attempts: int, error: str
    ) -> FailureDecision:
        hook = self._failure_hook
        if hook is None or self._bypassed(hook):
            return DEFAULT_FAILURE
        try:
            outcome = self._sandbox.on_failure(message_id, headers, attempts, error)
            if outcome[0] is True:
                _, action, delay_ms = outcome
                decision = FailureDecision(action, delay_ms)
            else:
                decision = None
        except Exception as exc:  # any failure becomes a fallback: see _unforeseen
            outcome, decision = _unforeseen(exc), None
        self._record(hook, outcome)
        return DEFAULT_FAILURE if decision is None else decision

    def _bypassed(self, hook: _Hook) -> bool:
        if hook.breaker.is_open(self._clock.now_ms()):
            hook.counters.bypassed += 1
            return True
        return False

    def _record(self, hook: _Hook, outcome: Outcome) -> None:
        ok = outcome[0] is True
        hook.breaker.record(ok, self._clock.now_ms())
        if ok:
            hook.counters.ok += 1
            return
        hook.counters.failed += 1
        text = str(outcome[1])[:ERROR_TEXT_MAX]
        hook.counters.last_error = text
        hook.counters.last_error_at_ms = self._clock.now_ms()
        self._failure_log.failed(hook.name, text)

    def _load(self, source: str, name: str, limits: LuaLimits) -> _Hook | None:
        if not source.strip():
            return None
        try:
            if self._strict:
                check_globals(source, self._sandbox.environment())
            self._sandbox.load(name, source)
        except ScriptError as exc:
            raise ScriptError(f"{name} script {exc}") from None
        return _Hook(name, _Breaker(limits.breaker_threshold, limits.breaker_cooldown_ms))


def _unforeseen(exc: Exception) -> Outcome:
    """A failure the sandbox did not turn into an outcome (a lupa error, an invalid
    result that slipped through). The message still gets the default decision: the
    core calls the hooks in the middle of moving it, and must not see an exception.
    """
    return (False, f"{type(exc).__name__}: {exc}")
