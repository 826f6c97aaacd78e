"""Brokers one at a time: start, run every cell for every repetition, stop.

One broker process serves all cells of one (broker, mode) pair, each cell on a fresh
queue; repetitions run the whole cell list again rather than repeating one cell back
to back, so a burst of noise from a neighbour lands on different cells. The broker's
CPU and memory are sampled for the whole of each repetition. Whatever happens (a
failed start, a failing cell, Ctrl-C), the broker is stopped and its temporary
directory removed before the next one starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from competitive.adapters import load
from competitive.adapters.base import BrokerAdapter
from competitive.cells import Cell, plan
from competitive.model import MIB, SECONDS, US_PER_MSG, CellKey, Measurement, Mode
from competitive.procs import BrokerStartError, temp_dir
from competitive.profile import Profile
from competitive.resources import TreeSampler

Status = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class RunConfig:
    profile: Profile
    brokers: Sequence[str]
    modes: Sequence[Mode]
    broker_cpu: int | None  # None: no pinning (a one-CPU host)
    run_id: str


def resource_keys(broker: str, mode: Mode) -> list[tuple[CellKey, str]]:
    return [
        (CellKey(broker, mode, "none", "cpu_seconds", None, None), SECONDS),
        (CellKey(broker, mode, "none", "cpu_per_msg", None, None), US_PER_MSG),
        (CellKey(broker, mode, "none", "peak_rss", None, None), MIB),
    ]


def all_keys(cells: Sequence[Cell], broker: str, mode: Mode) -> list[tuple[CellKey, str]]:
    keys = [k for cell in cells for k in cell.keys(broker, mode)]
    return keys + resource_keys(broker, mode)


async def run(
    config: RunConfig,
    status: Status,
    done: Callable[[list[Measurement]], None] | None = None,
) -> list[Measurement]:
    """Every broker and mode in turn; `done` gets everything measured so far after each
    one, so a long run that is interrupted still leaves what it finished."""
    cells = plan(config.profile)
    out: list[Measurement] = []
    for name in config.brokers:
        adapter_cls = load(name)
        for mode in config.modes:
            out += await run_broker(adapter_cls, mode, config, cells, status)
            if done is not None:
                done(list(out))
    return out


async def run_broker(
    adapter_cls: type[BrokerAdapter],
    mode: Mode,
    config: RunConfig,
    cells: Sequence[Cell],
    status: Status,
) -> list[Measurement]:
    name = adapter_cls.name
    note = adapter_cls.mode_note(mode)
    if (why := adapter_cls.missing()) is not None:
        return _flag(cells, name, mode, f"error: {why} (run bench-competitive/install.sh)", note)
    out: list[Measurement] = []
    with temp_dir(f"{name}-{mode}") as workdir:
        adapter = adapter_cls(
            mode, workdir, cpu=config.broker_cpu, instance=f"{config.run_id}:{name}:{mode}"
        )
        sampler_task: asyncio.Task[None] | None = None
        try:
            status(f"{name} {mode}: starting")
            try:
                await adapter.start()
            except BrokerStartError as exc:
                first = str(exc).splitlines()[0]
                return _flag(cells, name, mode, f"error: did not start: {first}", note)
            assert adapter.process is not None
            sampler = TreeSampler(adapter.instance, adapter.process.pid)
            sampler_task = asyncio.create_task(sampler.run())
            for rep in range(1, config.profile.reps + 1):
                sampler.begin_window()
                jobs = 0
                for cell in cells:
                    status(f"{name} {mode}: {cell.label} (rep {rep}/{config.profile.reps})")
                    outcome = await cell.run(adapter, rep)
                    out += outcome.measurements
                    jobs += outcome.jobs
                usage = sampler.end_window()
                load = f"load average {os.getloadavg()[0]:.1f} at its end"
                notes = "; ".join(n for n in (load, note) if n)
                out += _resources(name, mode, usage.cpu_seconds, usage.peak_rss_mib, jobs, notes)
        finally:
            if sampler_task is not None:
                sampler_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler_task
            status(f"{name} {mode}: stopping")
            await asyncio.shield(adapter.stop())
    return out


def _resources(
    broker: str, mode: Mode, cpu_s: float, rss_mib: float, jobs: int, note: str
) -> list[Measurement]:
    per_msg = cpu_s * 1e6 / jobs if jobs else None
    values = [cpu_s, per_msg, rss_mib]
    what = f"whole repetition, {jobs} jobs"
    merged = "; ".join(n for n in (what, note) if n)
    return [
        Measurement(key, value, unit, "ok", merged)
        for (key, unit), value in zip(resource_keys(broker, mode), values, strict=True)
    ]


def _flag(
    cells: Sequence[Cell], broker: str, mode: Mode, status: str, note: str
) -> list[Measurement]:
    return [Measurement(k, None, unit, status, note) for k, unit in all_keys(cells, broker, mode)]
