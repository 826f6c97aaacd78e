"""`python bench-competitive/run.py [--quick] [--brokers fila,redis,...] [--out DIR]`.

Pins itself (the load generator) to one CPU and every broker to the other, runs the
brokers one at a time, then writes `summary.json`, `RESULTS.md` and the charts into
the output directory. Exit status: 0 when every measured row passed its conservation
check, 1 when one failed or errored (the results are still written, with the failure
flagged), 2 for bad arguments, 130 when interrupted (brokers are stopped first).
`--clean` kills whatever a killed run left behind and removes its temporary
directories.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import signal
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from competitive.adapters import NAMES, load
from competitive.model import MODES, Measurement, Mode

if TYPE_CHECKING:  # the real imports wait until the process is pinned (see _main)
    from rich.console import Console

    from competitive.report.summary import Summary

HERE = Path(__file__).resolve().parent.parent  # bench-competitive/
REPO = HERE.parent
DEFAULT_BROKERS = NAMES
_PINNED_ENV = "BENCH_COMPETITIVE_PLACEMENT"  # "broker_cpu,client_cpu" after re-exec


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench-competitive/run.py",
        description="Fila beside Redis, NATS JetStream, RabbitMQ and beanstalkd.",
    )
    parser.add_argument("--quick", action="store_true", help="small counts, one repetition")
    parser.add_argument(
        "--brokers",
        default=",".join(DEFAULT_BROKERS),
        help=f"comma-separated, from {','.join(DEFAULT_BROKERS)} (default: all)",
    )
    parser.add_argument(
        "--modes", default="durable,buffered", help="durable,buffered (default: both)"
    )
    parser.add_argument("--reps", type=int, help="repetitions per cell (default: profile's)")
    parser.add_argument(
        "--out",
        type=Path,
        help="output directory (default: bench-competitive/results, or results/quick)",
    )
    parser.add_argument("--no-pin", action="store_true", help="do not pin to CPUs")
    parser.add_argument(
        "--clean", action="store_true", help="kill strays of killed runs, remove temp dirs"
    )
    args = parser.parse_args(argv)
    args.broker_list = [b.strip() for b in args.brokers.split(",") if b.strip()]
    unknown = [b for b in args.broker_list if b not in DEFAULT_BROKERS]
    if unknown or not args.broker_list:
        parser.error(f"unknown broker(s) {unknown}; choose from {','.join(DEFAULT_BROKERS)}")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.mode_list or any(m not in ("durable", "buffered") for m in args.mode_list):
        parser.error("--modes takes durable, buffered or both")
    if args.reps is not None and args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def _placement(no_pin: bool) -> tuple[int | None, int | None]:
    """(broker CPU, load-generator CPU), re-executing under taskset when needed."""
    if no_pin:
        return None, None
    pinned = os.environ.get(_PINNED_ENV)
    if pinned:
        broker, client = (int(x) for x in pinned.split(","))
        return broker, client
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or shutil.which("taskset") is None:
        return None, None
    broker, client = cpus[0], cpus[1]
    os.environ[_PINNED_ENV] = f"{broker},{client}"
    os.execvp("taskset", ["taskset", "-c", str(client), sys.executable, *sys.argv])
    raise AssertionError("unreachable: execvp returned")


def _placement_text(broker: int | None, client: int | None) -> str:
    if broker is None or client is None:
        return "not pinned (fewer than two CPUs available, no taskset, or --no-pin)"
    return (
        f"broker pinned to CPU {broker} and load generator (one Python process with its "
        f"client threads) to CPU {client}, with taskset; brokers run one at a time"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.clean:
        from competitive.procs import clean

        killed, dirs = clean()
        print(f"bench-clean: killed {len(killed)} process(es) {killed}, removed {len(dirs)} dir(s)")
        return 0
    broker_cpu, client_cpu = _placement(args.no_pin)
    return asyncio.run(_main(args, argv, broker_cpu, client_cpu))


async def _main(
    args: argparse.Namespace, argv: list[str], broker_cpu: int | None, client_cpu: int | None
) -> int:
    # Imported here, after pinning, so no client library starts threads unpinned.
    from rich.console import Console

    from competitive import machine
    from competitive.profile import FULL, QUICK
    from competitive.report import markdown
    from competitive.report.summary import Summary, write
    from competitive.runner import RunConfig, run
    from competitive.stats import aggregate

    console = Console()
    profile = QUICK if args.quick else FULL
    if args.reps is not None:
        profile = dataclasses.replace(profile, reps=args.reps)
    out: Path = args.out or (HERE / "results" / ("quick" if args.quick else ""))
    command = " ".join(["python", "bench-competitive/run.py", *argv])
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)

    versions: dict[str, str] = {}
    info: dict[str, dict[str, Any]] = {}
    for name in args.broker_list:
        cls = load(name)
        missing = cls.missing()
        versions[name] = "not installed" if missing else cls.version()
        info[name] = {
            "title": cls.title,
            "version": versions[name],
            "client": cls.client_library,
            "durable": cls.settings("durable"),
            "buffered": cls.settings("buffered"),
            "batching": cls.batching(),
            "notes": {m: cls.mode_note(m) for m in MODES},
        }
    described = machine.describe(versions)
    described["brokers"] = info
    load_start = machine.loadavg()
    started = time.monotonic()
    timestamp = datetime.now(UTC).isoformat(timespec="seconds")
    measured_commit = machine.commit(REPO)  # at the start: the code that was measured
    config = RunConfig(profile, args.broker_list, args.mode_list, broker_cpu, uuid.uuid4().hex[:8])
    console.log(
        f"{command}: {profile.name} profile, placement: {_placement_text(broker_cpu, client_cpu)}"
    )
    if load_start > machine.BUSY_LOADAVG:
        console.log(
            f"[yellow]load average {load_start} at start: the machine is busy; expect noise"
        )

    def summarize(measurements: list[Measurement], state: str) -> Summary:
        """The summary of what was measured; `state` is "complete" or why it is not."""
        run_info: dict[str, Any] = {
            "profile": profile.name,
            "reps": profile.reps,
            "command": command,
            "duration_s": round(time.monotonic() - started, 1),
            "loadavg": {"start": load_start, "end": machine.loadavg()},
            "busy": max(load_start, machine.loadavg()) > machine.BUSY_LOADAVG,
            "client_cpu": client_cpu,
            "broker_cpu": broker_cpu,
            "state": state,
        }
        return Summary(
            commit=measured_commit,
            timestamp=timestamp,
            machine={**described, "run": run_info},
            placement=_placement_text(broker_cpu, client_cpu),
            rows=aggregate(measurements),
        )

    def save(summary: Summary, charts_too: bool) -> list[Path]:
        write(summary, out / "summary.json")
        (out / "RESULTS.md").write_text(markdown.render(summary), encoding="utf-8")
        return _charts(summary, out, console) if charts_too else []

    def checkpoint(measurements: list[Measurement]) -> None:
        brokers = sorted({m.key.broker for m in measurements})
        save(summarize(measurements, f"partial: finished {', '.join(brokers)} so far"), False)

    so_far: list[Measurement] = []

    def keep(measurements: list[Measurement]) -> None:
        so_far[:] = measurements
        checkpoint(measurements)

    interactive = console.is_terminal
    with console.status("starting") as status:

        def report(text: str) -> None:
            if interactive:
                status.update(text)
            else:
                console.log(text)

        try:
            measurements = await run(config, report, keep)
        except asyncio.CancelledError:
            if so_far:
                state = "interrupted: " + ", ".join(sorted({m.key.broker for m in so_far}))
                save(summarize(so_far, state), True)
                console.log(f"[red]interrupted: brokers stopped; partial results in {out}")
            else:
                console.log("[red]interrupted: brokers stopped, nothing written")
            return 130
    summary = summarize(measurements, "complete")
    charts = save(summary, True)
    _print(console, summary)
    console.log(
        f"wrote {out / 'summary.json'}, {out / 'RESULTS.md'} and {len(charts)} chart(s) "
        f"in {summary.machine['run']['duration_s']} s"
    )
    failed = summary.failed
    if failed:
        console.log(f"[red]{len(failed)} row(s) failed their checks:")
        for row in failed:
            console.log(
                f"  {row.broker} {row.mode} {row.workload} c={row.connections}: {row.conservation}"
            )
        return 1
    return 0


def _charts(summary: Summary, out: Path, console: Console) -> list[Path]:
    try:
        from competitive.report import charts
    except ImportError as exc:  # matplotlib is in the optional `bench` extra
        console.log(f"[yellow]no charts: {exc} (pip install -e '.[bench]')")
        return []
    return charts.write_all(summary, out)


def _print(console: Console, summary: Summary) -> None:
    """The headline figures on the terminal: enqueue / drain per connection count."""
    from rich.table import Table

    from competitive.report.markdown import Index, fmt_cell

    ix = Index(summary.rows, summary.machine)
    size = 256
    conns = sorted(
        {
            k.connections
            for k in ix.by_key
            if k.workload == "enqueue" and k.batching == "none" and k.payload_bytes == size
            and k.connections is not None
        }
    )  # fmt: skip
    table = Table(title="enqueue / drain jobs/s (median)")
    for name in ("broker", "mode"):
        table.add_column(name)
    for n in conns:
        table.add_column(f"{n} conn.", justify="right")
    table.add_column("batched", justify="right")
    table.add_column("p99 ms", justify="right")

    def pair(mode: Mode, n: int, batching: str = "none") -> str:
        enq = ix.get(b, mode, "enqueue", n, size, batching)
        drn = ix.get(b, mode, "drain", n, size, batching)
        return f"{fmt_cell(enq, show_range=False)} / {fmt_cell(drn, show_range=False)}"

    for b in ix.brokers:
        for mode in MODES:
            p99 = fmt_cell(ix.get(b, mode, "latency_p99", 1, size), show_range=False)
            table.add_row(
                ix.title(b), mode, *(pair(mode, n) for n in conns), pair(mode, 1, "native"), p99
            )
    console.print(table)
