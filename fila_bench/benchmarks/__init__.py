"""Every benchmark of `fila-bench system`, in the order they run (SPEC section 8).

Cheap, time-bounded cases come first so a quick run reports the headline numbers
early; the durability matrix, the longest, comes last. The echo ceiling is first:
its windows are measured by the runner between the cases with rates
(`fila_bench.runner`), and this entry makes it selectable on its own.
"""

from __future__ import annotations

import importlib.resources

from fila_bench.case import Case, Context
from fila_bench.echo import ECHO_CASE
from fila_bench.results import Result


def keys_script() -> str:
    """The `on_enqueue` hook that takes fairness key and weight from headers."""
    script = importlib.resources.files("fila_bench.benchmarks").joinpath("keys.lua")
    return script.read_text("utf-8")


CEILING_ROWS = (ECHO_CASE, f"{ECHO_CASE}_spread_pct")  # added by the runner, not the case


def all_cases() -> list[Case]:
    # Imported here: the modules import keys_script from this package.
    from fila_bench.benchmarks import (
        batch,
        cluster,
        competitive,
        durability,
        enqueue,
        latency,
        lua,
        replication,
        resources,
        scheduling,
        throttle,
    )

    return [
        Case(ECHO_CASE, CEILING_ROWS, _ceiling_only, optional=CEILING_ROWS),
        *enqueue.CASES,
        *latency.CASES,
        *scheduling.CASES,
        *lua.CASES,
        *throttle.CASES,
        *resources.CASES,
        *cluster.CASES,
        *replication.CASES,
        *durability.CASES,
        # The competitive harness's cells of few connections, and the unary path.
        *competitive.CASES,
        # The batch paths: rows of their own, not one-in-flight figures (no ratios).
        *batch.CASES,
    ]


async def _ceiling_only(ctx: Context) -> list[Result]:
    """Nothing of its own: the runner's windows before and after it are the measurement."""
    return []
