"""Every benchmark of `fila-bench system`, in the order they run (SPEC section 8).

Cheap, time-bounded cases come first so a quick run reports the headline numbers
early; the durability matrix, the longest, comes last.
"""

from __future__ import annotations

import importlib.resources

from fila_bench.case import Case


def keys_script() -> str:
    """The `on_enqueue` hook that takes fairness key and weight from headers."""
    script = importlib.resources.files("fila_bench.benchmarks").joinpath("keys.lua")
    return script.read_text("utf-8")


def all_cases() -> list[Case]:
    # Imported here: the modules import keys_script from this package.
    from fila_bench.benchmarks import (
        durability,
        enqueue,
        latency,
        lua,
        resources,
        scheduling,
        throttle,
    )

    return [
        *enqueue.CASES,
        *latency.CASES,
        *scheduling.CASES,
        *lua.CASES,
        *throttle.CASES,
        *resources.CASES,
        *durability.CASES,
    ]
