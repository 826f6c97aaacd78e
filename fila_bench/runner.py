"""Runs the selected cases in order under one progress display and collects a Report.

A case that fails (its conservation or fairness check, a broker that would not
start, an RPC error, a deadline) is recorded and the run moves on, so one broken
benchmark does not hide the numbers of the others; the CLI then exits non-zero.
Programming errors are not caught: they should stop the run with a traceback.

The runner also owns what every case shares: the CPU placement (this process is
pinned to the load generator's CPUs before any gRPC thread starts) and the echo
server of `echo_ceiling_50c`. It measures a short echo window before the first case
with closed-loop rates and after every one, so the ceiling is sampled across the
whole run, and reports each rate also as a ratio to `echo_ceiling_50c`, the median of
those windows. Those ratios are the gated figures: a slower or busier host slows the
echo server and the broker alike, so the ratio keeps what the broker changed and
drops what the host did. (Dividing each rate by the windows just around its case
instead was tried and measured worse: a one-second window on a shared host carries
its own noise into the ratio; see docs/benchmarks.md, "Noise and the gate".) The raw
msg/s rows stay, unchanged and comparable with published figures, but informational.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from fila.testing.server import ServerStartError
from fila_bench.case import Case, Context, ratio_name
from fila_bench.cpus import Placement, pin_process
from fila_bench.echo import ECHO_CASE, EchoCeiling, echo_ceiling
from fila_bench.load import CheckFailed
from fila_bench.profile import Profile
from fila_bench.results import (
    MSG_S,
    PCT,
    RATIO,
    Failure,
    Report,
    Result,
    environment,
    git_commit,
    now_iso,
    throughput,
)
from fila_sdk import FilaError

# What a benchmark can fail with that is the broker's fault, not the benchmark's.
_CASE_FAILURES = (FilaError, grpc.RpcError, ServerStartError, TimeoutError, OSError)


_MAX_ERROR_LINES = 12  # a broker that failed to start explains itself in its log tail
_E = TypeVar("_E", bound=BaseException)


class UnknownBenchmark(ValueError):
    """`--only` named something that is neither a case nor a result."""


def select(cases: Sequence[Case], only: Sequence[str]) -> list[Case]:
    if not only:
        return list(cases)
    unknown = [p for p in only if not any(c.matches(p) for c in cases)]
    if unknown:
        raise UnknownBenchmark(f"no benchmark matches {', '.join(unknown)}")
    return [c for c in cases if any(c.matches(p) for p in only)]


def run_all(
    cases: Sequence[Case],
    profile: Profile,
    workdir: Path,
    console: Console,
    placement: Placement | None = None,
) -> Report:
    report = Report(
        commit=git_commit(),
        timestamp=now_iso(),
        extra={
            "profile": profile.name,
            "telemetry_scrape_s": profile.telemetry_scrape_s,
            "environment": environment(),
        },
    )
    report.extra["environment"]["cpu_pinning"] = _pin_self(placement)
    if report.extra["environment"]["cpu_pinning"] == "refused":
        placement = None
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("starting", total=len(cases))
        asyncio.run(_run_cases(cases, profile, workdir, placement, report, progress, task))
        progress.update(task, description="done")
    report.extra["environment"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return report


def _pin_self(placement: Placement | None) -> str:
    """Pins this process to the load generator's CPUs; says what happened, for the JSON."""
    if placement is None:
        return "off"
    try:
        pin_process(os.getpid(), placement.client)
    except OSError:
        return "refused"
    return placement.describe()


def _missing(case: Case, results: list[Result]) -> list[str]:
    """The case's promised outputs it did not return (ratios are the runner's own)."""
    names = {r.name for r in results}
    return [n for n in case.outputs if n not in names and n not in case.optional]


def needs_ceiling(case: Case) -> bool:
    return bool(case.ratios) or case.name == ECHO_CASE


async def _run_cases(
    cases: Sequence[Case],
    profile: Profile,
    workdir: Path,
    placement: Placement | None,
    report: Report,
    progress: Progress,
    task: TaskID,
) -> None:
    # One event loop for the whole run: grpc.aio objects must not outlive their loop.
    seconds: dict[str, float] = report.extra.setdefault("case_seconds", {})
    ceiling: EchoCeiling | None = None
    async with contextlib.AsyncExitStack() as stack:
        if any(needs_ceiling(c) for c in cases):
            progress.update(task, description=f"[bold]{ECHO_CASE}[/] starting the echo server")
            try:
                ceiling = await stack.enter_async_context(
                    echo_ceiling(placement.server if placement else None)
                )
            except _CASE_FAILURES as err:
                report.failures.append(Failure(ECHO_CASE, _describe(err)))
        before: float | None = None  # the window that closed the previous case
        ratio_names: list[str] = []
        for case in cases:

            def status(text: str, name: str = case.name) -> None:
                progress.update(task, description=f"[bold]{name}[/] {text}")

            bracket = ceiling if needs_ceiling(case) else None
            if bracket is not None and before is None:
                before = await _window(bracket, profile, status, report)
            status("starting broker")
            started = time.perf_counter()
            results: list[Result] = []
            failed = False
            # except*: failures inside a TaskGroup (a producer's RPC error) arrive grouped.
            try:
                results = await case.run(Context(profile, workdir, status, placement))
            except* CheckFailed as group:
                failed = True
                for exc in _leaves(group):
                    results += exc.results
                    report.failures.append(Failure(case.name, str(exc)))
            except* _CASE_FAILURES as group:
                failed = True
                first = _leaves(group)[0]
                report.failures.append(Failure(case.name, _describe(first)))
            seconds[case.name] = round(time.perf_counter() - started, 1)
            if not failed and (missing := _missing(case, results)):
                report.failures.append(Failure(case.name, f"no figure for {', '.join(missing)}"))
            after = None
            if bracket is not None and before is not None:
                after = await _window(bracket, profile, status, report)
                ratio_names += case.ratios
            before = after
            if bracket is not None and after is None:
                ceiling = None  # the echo server failed (recorded): no more ratios
            report.results += results
            progress.advance(task)
        if ceiling is not None and ceiling.windows:
            report.extra["echo_windows"] = [round(w, 1) for w in ceiling.windows]
            rows = ceiling_rows(ceiling.windows)
            report.results = with_ratios(report.results, ratio_names, rows[0].value) + rows


async def _window(
    ceiling: EchoCeiling, profile: Profile, status: Callable[[str], None], report: Report
) -> float | None:
    """One echo window, or None (and a recorded failure) if the echo server broke."""
    status(f"{ECHO_CASE} window")
    try:
        return await ceiling.measure(profile.ceiling_warmup_s, profile.ceiling_measure_s)
    except* _CASE_FAILURES as group:
        report.failures.append(Failure(ECHO_CASE, _describe(_leaves(group)[0])))
    return None


def with_ratios(results: list[Result], names: Sequence[str], ceiling: float) -> list[Result]:
    """Adds `<name>_ratio` for each of `names` and ungates the raw rate it came from;
    the ratio is gated as the rate was (a latency-bound rate stays ungated)."""
    out: list[Result] = []
    for result in results:
        if result.name in names and result.unit == MSG_S and ceiling > 0:
            out.append(dataclasses.replace(result, gated=False))
            ratio = result.value / ceiling
            out.append(Result(ratio_name(result.name), ratio, RATIO, True, result.gated))
        else:
            out.append(result)
    return out


def ceiling_rows(windows: Sequence[float]) -> list[Result]:
    """The ceiling itself (median of the run's windows) and how much it moved in the run:
    the second row is the host's noise, measured, next to the figures it affected."""
    median = statistics.median(windows)
    spread = (max(windows) - min(windows)) / median * 100 if median else 0.0
    return [
        dataclasses.replace(throughput(ECHO_CASE, median), gated=False),
        Result(f"{ECHO_CASE}_spread_pct", spread, PCT, higher_is_better=False, gated=False),
    ]


def _leaves(group: BaseExceptionGroup[_E]) -> list[_E]:
    leaves: list[_E] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            leaves += _leaves(exc)
        else:
            leaves.append(exc)
    return leaves


def _describe(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()[:_MAX_ERROR_LINES]
    return f"{type(exc).__name__}: " + "\n".join(lines)
