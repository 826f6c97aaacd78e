"""A queue's `on_enqueue` and `on_failure` hooks, with fallback and circuit breaker.

A hook that errors, runs out of budget or returns the wrong shape must not fail
the request: the message gets the default decision and the failure is counted.
After `threshold` consecutive failures the hook is bypassed for `cooldown`, so
a broken script costs at most a few budgets per cooldown instead of one per
message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fila.core.clock import Clock
from fila.lua.sandbox import LuaSandbox, ScriptError

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
    fn: Any
    breaker: _Breaker
    counters: HookCounters = field(default_factory=HookCounters)


def validate_scripts(on_enqueue: str, on_failure: str, limits: LuaLimits) -> None:
    """Raises ScriptError if either script would be refused at queue creation."""
    QueueHooks("validation", on_enqueue, on_failure, limits, lambda _key: None, _NO_CLOCK)


class _NoClock:
    def now_ms(self) -> int:
        return 0

    def now_s(self) -> float:
        return 0.0


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
    ) -> None:
        self._queue = queue
        self._clock = clock
        self._sandbox = LuaSandbox(
            timeout_ms=limits.timeout_ms,
            memory_limit_bytes=limits.memory_limit_bytes,
            config_get=config_get,
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
        if hook is None:
            return DEFAULT_ENQUEUE
        sandbox = self._sandbox
        result = self._run(
            hook, sandbox.run_on_enqueue, sandbox.table(dict(headers)), payload_size, self._queue
        )
        if result is None:
            return DEFAULT_ENQUEUE
        _, key, weight, joined = result
        return EnqueueDecision(key, weight, tuple(joined.split("\0")) if joined else ())

    def on_failure(
        self, message_id: str, headers: Mapping[str, str], attempts: int, error: str
    ) -> FailureDecision:
        hook = self._failure_hook
        if hook is None:
            return DEFAULT_FAILURE
        sandbox = self._sandbox
        result = self._run(
            hook,
            sandbox.run_on_failure,
            message_id,
            sandbox.table(dict(headers)),
            attempts,
            self._queue,
            error,
        )
        if result is None:
            return DEFAULT_FAILURE
        _, action, delay_ms = result
        return FailureDecision(action, int(delay_ms))

    def _run(self, hook: _Hook, entry_point: Any, *args: Any) -> tuple[Any, ...] | None:
        now_ms = self._clock.now_ms()
        if hook.breaker.is_open(now_ms):
            hook.counters.bypassed += 1
            return None
        result = self._sandbox.call(entry_point, hook.fn, *args)
        ok = result[0] is True
        hook.breaker.record(ok, now_ms)
        if ok:
            hook.counters.ok += 1
            return result
        hook.counters.failed += 1
        hook.counters.last_error = str(result[1])
        log.warning("lua hook failed queue=%s error=%s", self._queue, hook.counters.last_error)
        return None

    def _load(self, source: str, name: str, limits: LuaLimits) -> _Hook | None:
        if not source.strip():
            return None
        try:
            fn = self._sandbox.load(source, (name,))[name]
        except ScriptError as exc:
            raise ScriptError(f"{name} script {exc}") from None
        return _Hook(fn, _Breaker(limits.breaker_threshold, limits.breaker_cooldown_ms))
