"""A Lua 5.4 state that runs untrusted policy code without harming the broker.

Each queue gets its own state, so one queue's globals, garbage and failures
never touch another's. `sandbox.lua` strips the standard library down to pure
computation and installs an instruction-count hook that enforces a CPU budget
per call; lupa's allocator cap bounds memory. Lupa's Python bridge is closed:
the only Python callable a script can reach is `fila.get`, and the attribute
filter refuses every attribute of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from importlib import resources
from typing import Any, cast

from lupa import lua54

_BOOTSTRAP = resources.files("fila.lua").joinpath("sandbox.lua").read_text()


class ScriptError(Exception):
    """A script failed to compile, run or define its hook."""


def _refuse_attributes(obj: object, name: object, is_setting: bool) -> str:
    raise AttributeError("Python objects are not accessible from Lua")


class LuaSandbox:
    def __init__(
        self,
        *,
        timeout_ms: int,
        memory_limit_bytes: int,
        config_get: Callable[[str], str | None],
    ) -> None:
        self._budget_s = timeout_ms / 1000.0
        self._runtime = lua54.LuaRuntime(
            max_memory=0,
            register_eval=False,
            register_builtins=False,
            unpack_returned_tuples=True,
            attribute_filter=_refuse_attributes,
        )
        entry_points = self._runtime.execute(_BOOTSTRAP)
        (
            self._run_chunk,
            self.run_on_enqueue,
            self.run_on_failure,
            self._run_collect,
        ) = entry_points
        fila_table = self._runtime.table_from({"get": _config_getter(config_get)})
        self._runtime.globals()["fila"] = fila_table
        self._memory_limit = memory_limit_bytes
        self._runtime.set_max_memory(memory_limit_bytes, total=False)

    @property
    def budget_s(self) -> float:
        return self._budget_s

    def load(self, source: str, hook_names: tuple[str, ...]) -> dict[str, Any]:
        """Compiles and runs a script's top level; returns the hook functions it defines."""
        if "\x1bLua" in source or source.startswith("\x1b"):
            raise ScriptError("precompiled Lua bytecode is not accepted")
        lua_globals = self._runtime.globals()
        for name in hook_names:
            lua_globals[name] = None  # a hook must come from this script, not an earlier one
        try:
            chunk = self._runtime.compile(source)
        except (lua54.LuaError, lua54.LuaSyntaxError) as exc:
            raise ScriptError(f"does not compile: {_clean(exc)}") from None
        ok, err = self.call(self._run_chunk, chunk)
        if not ok:
            raise ScriptError(f"failed while loading: {err}")
        found: dict[str, Any] = {}
        for name in hook_names:
            fn = lua_globals[name]
            if lua54.lua_type(fn) != "function":
                raise ScriptError(f"does not define a function {name}(msg)")
            found[name] = fn
        return found

    def table(self, mapping: dict[str, str]) -> Any:
        return self._runtime.table_from(mapping)

    def call(self, entry_point: Any, *args: Any) -> tuple[Any, ...]:
        """Calls an entry point of sandbox.lua; a Lua-level failure becomes (False, reason)."""
        return self._call(entry_point, self._budget_s, *args)

    def _call(self, entry_point: Any, *args: Any) -> tuple[Any, ...]:
        try:
            result = entry_point(*args)
        except lua54.LuaMemoryError:
            self._collect()
            return (False, "memory limit exceeded")
        except lua54.LuaError as exc:
            self._collect()
            return (False, _clean(exc))
        if not isinstance(result, tuple):
            result = (result,)
        if result[0] is not True:
            self._collect()
        return cast(tuple[Any, ...], result)

    def _collect(self) -> None:
        """Frees what a failed call left behind so the next call gets the full memory cap."""
        # Out of memory even for the collector call: the next failed call retries.
        with contextlib.suppress(lua54.LuaError):
            self._run_collect(self._budget_s)


def _config_getter(config_get: Callable[[str], str | None]) -> Callable[[object], str | None]:
    def get(key: object) -> str | None:
        return config_get(key) if isinstance(key, str) else None

    return get


def _clean(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
