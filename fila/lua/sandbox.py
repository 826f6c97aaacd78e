"""A Lua 5.4 state that runs untrusted policy code without harming the broker.

Each queue gets its own state, so one queue's globals, garbage and failures never
touch another's. The Lua side (`sandbox.lua`, with `strings.lua` and `patterns.lua`)
strips the standard library to pure computation, runs scripts in their own
environment on a worker coroutine that carries a CPU budget, and returns the entry
points called here. Lupa's Python bridge is closed: a script reaches Python only
through `fila.get`, `print` and the sandbox's own callbacks, and the attribute filter
refuses every attribute of them.

This side owns the memory cap. Lupa pushes call arguments and looks up globals
outside any protected call, where a failed allocation aborts the process ("PANIC:
unprotected error in call to Lua API"). So the cap is lifted whenever no entry point
runs, and each entry point sets it (`_Gate.arm`) once its arguments are in Lua. What
crosses is bounded beforehand (`inputs.py`), and entry points return only booleans,
numbers and strings, which lupa reads without allocating in Lua.

The budget is charged to the calling thread's CPU time (`time.thread_time`), so the
broker's other threads (fsync, RocksDB compaction, gRPC) cannot use it up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any, cast

from lupa import lua54

from fila.lua import inputs
from fila.lua.script_log import PRINT_MAX_BYTES, ScriptLog

# What sandbox.lua raises when a call runs out of its CPU budget.
BUDGET_EXHAUSTED = b"CPU budget exhausted"
# A call that held its thread this many budgets (at least MIN_STALL_S) where the budget
# is never checked fails even if it finished: see `_call`.
STALL_BUDGETS = 10
MIN_STALL_S = 0.1
# the largest script accepted; compiling is one C call the budget cannot interrupt
MAX_SCRIPT_BYTES = 256 * 1024


def _bytecode(names: tuple[str, ...]) -> tuple[bytes, ...]:
    """The sandbox's modules, compiled once per process and dumped without debug
    information. Every queue's state loads this bytecode: a state is smaller and
    several times faster to build than from source (figures: docs/benchmarks.md,
    "Measurements behind design choices"). Only this trusted bytecode is ever loaded
    in binary mode; scripts are text only."""
    runtime = lua54.LuaRuntime(encoding=None, register_eval=False, register_builtins=False)
    dump = runtime.eval(
        "function(src, name) return string.dump(assert(load(src, name, 't')), true) end"
    )
    files = resources.files("fila.lua")
    return tuple(
        dump(files.joinpath(f"{n}.lua").read_bytes(), f"=fila.{n}".encode()) for n in names
    )


_SANDBOX, _STRINGS, _PATTERNS = _bytecode(("sandbox", "strings", "patterns"))

# The budget's check granularity (see sandbox.lua): at most WINDOW_MAX instructions
# between checks and at least WINDOW_MIN; in between, window * (memory the scripts
# hold, in KiB) stays about WINDOW_KB, so WINDOW_MAX up to 16 KiB and WINDOW_MIN at
# 1 MiB. And a check after DEBT_LIMIT steps (about a nanosecond each) of C work.
WINDOW_MAX = 1000
WINDOW_MIN = 16
WINDOW_KB = 16 * WINDOW_MAX
DEBT_LIMIT = 1_000_000


class ScriptError(Exception):
    """A script failed to compile, run or define its hook."""


def _refuse_attributes(obj: object, name: object, is_setting: bool) -> str:
    raise AttributeError("Python objects are not accessible from Lua")


class _Gate:
    """Sets and lifts the state's memory cap. Its methods are called from Lua."""

    __slots__ = ("limit", "runtime")

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime
        self.limit = 0

    def arm(self) -> None:
        self.runtime.set_max_memory(self.limit, True)

    def lift(self) -> None:
        self.runtime.set_max_memory(0)


# Outcome of a hook call: (True, results...) or (False, error text).
Outcome = tuple[Any, ...]


class LuaSandbox:
    def __init__(
        self,
        *,
        queue: str,
        timeout_ms: int,
        memory_limit_bytes: int,
        config_get: Callable[[str], str | None],
        script_log: ScriptLog | None = None,
        wall_clock: Callable[[], float] = time.perf_counter,
        thread_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        """`wall_clock` and `thread_clock` (the calling thread's CPU time, which the
        budget is charged to) are for tests."""
        self._wall_clock = wall_clock
        self._thread_clock = thread_clock
        self._budget_s = timeout_ms / 1000.0
        self._stall_s = max(STALL_BUDGETS * self._budget_s, MIN_STALL_S)
        self._suspect = False  # the last call held its thread past the stall bound
        runtime = lua54.LuaRuntime(
            max_memory=0,
            encoding=None,
            register_eval=False,
            register_builtins=False,
            unpack_returned_tuples=True,
            attribute_filter=_refuse_attributes,
        )
        gate = _Gate(runtime)
        log = script_log if script_log is not None else ScriptLog(queue)

        def get(key: bytes) -> bytes | None:
            try:
                value = config_get(key.decode())
            except UnicodeDecodeError:
                value = None
            finally:
                gate.lift()  # lupa pushes the value after this returns
            return None if value is None else value.encode()

        limits = runtime.table_from(
            {
                b"window_max": WINDOW_MAX,
                b"window_min": WINDOW_MIN,
                b"window_kb": WINDOW_KB,
                b"debt_limit": DEBT_LIMIT,
                b"print_max": PRINT_MAX_BYTES,
            }
        )
        entry_points = runtime.execute(
            _SANDBOX,
            runtime.compile(_PATTERNS, name=b"=fila.patterns", mode=b"b"),
            runtime.compile(_STRINGS, name=b"=fila.strings", mode=b"b"),
            gate.arm,
            thread_clock,
            get,
            log.emit,
            self._budget_s,
            limits,
            name=b"=fila.sandbox",
            mode=b"b",
        )
        self._load, self._on_enqueue, self._on_failure, names = entry_points
        self._names: bytes = names
        # the cap counts what scripts add to the state, not the sandbox itself
        gate.limit = runtime.get_memory_used(total=True) + memory_limit_bytes
        self._runtime = runtime
        self._gate = gate
        self._queue = inputs.clip(queue, 1024)

    @property
    def budget_s(self) -> float:
        return self._budget_s

    def environment(self) -> dict[str, frozenset[str]]:
        """What a script can reach: each global, with its members when it is a table
        (`string`, `math`, `fila`, ...); as built, before any script ran."""
        found: dict[str, frozenset[str]] = {}
        for line in self._names.decode().splitlines():
            name, *members = line.split(" ")
            found[name] = frozenset(members)
        return found

    def load(self, name: str, source: str) -> None:
        """Compiles and runs a script's top level, which must define function `name`."""
        data = source.encode("utf-8", "replace")
        if data.startswith(b"\x1b"):
            raise ScriptError("precompiled Lua bytecode is not accepted")
        if len(data) > MAX_SCRIPT_BYTES:
            raise ScriptError(f"is {len(data)} bytes; scripts are limited to {MAX_SCRIPT_BYTES}")
        outcome = self._call(self._load, name.encode(), data)
        if outcome[0] is True:
            return
        kind, text = (outcome[1], outcome[2]) if len(outcome) > 2 else (b"error", outcome[1])
        message = _text(text)
        if kind == b"compile":
            raise ScriptError(f"does not compile: {message}")
        if kind == b"missing":
            raise ScriptError(f"does not define a function {name}(msg)")
        raise ScriptError(f"failed while loading: {message}")

    def on_enqueue(self, headers: Mapping[str, str], payload_size: int) -> Outcome:
        """(True, fairness_key, weight, throttle_keys) or (False, error text)."""
        outcome = self._call(
            self._on_enqueue, payload_size, self._queue, *inputs.header_args(headers)
        )
        if outcome[0] is not True:
            return (False, _text(outcome[1] if len(outcome) > 1 else b""))
        _, key, weight, joined = outcome
        throttle_keys = tuple(joined.decode().split("\0")) if joined else ()
        return (True, key.decode(), weight, throttle_keys)

    def on_failure(
        self, message_id: str, headers: Mapping[str, str], attempts: int, error: str
    ) -> Outcome:
        """(True, action, delay_ms) or (False, error text)."""
        outcome = self._call(
            self._on_failure,
            inputs.clip(message_id, inputs.HEADER_STRING_MAX_BYTES),
            attempts,
            self._queue,
            inputs.clip(error, inputs.ERROR_MAX_BYTES),
            *inputs.header_args(headers),
        )
        if outcome[0] is not True:
            return (False, _text(outcome[1] if len(outcome) > 1 else b""))
        _, action, delay_ms = outcome
        return (True, action.decode(), delay_ms)

    def _call(self, entry_point: Any, *args: Any) -> Outcome:
        """Runs an entry point. A call can hold its thread long where the budget is never
        checked (one instruction can: a chain of __call metamethods is followed inside
        one OP_CALL) and finish before the next check; failing such calls lets the
        breaker stop a script that does it every time. Wall time alone cannot tell that
        from a short call whose thread waited for a CPU (a loaded host, a busy GIL), and
        reading the thread's CPU clock twice per call costs a large share of a small
        hook (docs/benchmarks.md). So a call that held its thread past the stall bound
        makes the next call of this state measure its own CPU time, and a measured call
        over the bound fails: a script that stalls every time fails from its second
        call on, and a descheduled one never does."""
        measured = self._suspect
        clock = self._thread_clock if measured else self._wall_clock
        started = clock()
        try:
            result = entry_point(*args)
        finally:
            self._gate.lift()
        held = clock() - started
        if not isinstance(result, tuple):
            result = (result,)
        self._suspect = held > self._stall_s
        if result[0] is True and measured and self._suspect:
            result = (False, BUDGET_EXHAUSTED)
        if result[0] is not True:
            # free what the failed call left, so the next call gets the whole cap
            self._runtime.gccollect()
        return cast(Outcome, result)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)
