"""Runs the selected cases in order under one progress display and collects a Report.

A case that fails (its conservation or fairness check, a broker that would not
start, an RPC error, a deadline) is recorded and the run moves on, so one broken
benchmark does not hide the numbers of the others; the CLI then exits non-zero.
Programming errors are not caught: they should stop the run with a traceback.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
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

from fila.server.process import ServerStartError
from fila_bench.case import Case, Context
from fila_bench.load import CheckFailed
from fila_bench.profile import Profile
from fila_bench.results import Failure, Report, environment, git_commit, now_iso
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


def run_all(cases: Sequence[Case], profile: Profile, workdir: Path, console: Console) -> Report:
    report = Report(
        commit=git_commit(),
        timestamp=now_iso(),
        extra={"profile": profile.name, "environment": environment()},
    )
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("starting", total=len(cases))
        asyncio.run(_run_cases(cases, profile, workdir, report, progress, task))
        progress.update(task, description="done")
    report.extra["environment"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return report


async def _run_cases(
    cases: Sequence[Case],
    profile: Profile,
    workdir: Path,
    report: Report,
    progress: Progress,
    task: TaskID,
) -> None:
    # One event loop for the whole run: grpc.aio objects must not outlive their loop.
    seconds: dict[str, float] = report.extra.setdefault("case_seconds", {})
    for case in cases:

        def status(text: str, name: str = case.name) -> None:
            progress.update(task, description=f"[bold]{name}[/] {text}")

        status("starting broker")
        started = time.perf_counter()
        # except*: failures inside a TaskGroup (a producer's RPC error) arrive grouped.
        try:
            report.results += await case.run(Context(profile, workdir, status))
        except* CheckFailed as group:
            for exc in _leaves(group):
                report.results += exc.results
                report.failures.append(Failure(case.name, str(exc)))
        except* _CASE_FAILURES as group:
            first = _leaves(group)[0]
            report.failures.append(Failure(case.name, _describe(first)))
        seconds[case.name] = round(time.perf_counter() - started, 1)
        progress.advance(task)


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
