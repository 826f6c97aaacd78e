#!/usr/bin/env python3
"""Chosen cells of the competitive harness, several sides in alternating rounds.

    .venv/bin/python scripts/ab_harness.py [--side NAME=PYTHONPATH ...] [--rabbitmq]
        [--cells c1_b256,c8_b256,c50_b256,lifecycle,multi] [--rounds 3] [--mode durable]

A side is Fila with `fila` and `fila_sdk` taken from PYTHONPATH (a checkout made with
`git worktree add --detach DIR REV`; empty: this checkout), so both the broker and
the load generator's SDK are that commit's; `--rabbitmq` adds RabbitMQ as a side.
Each round runs every side once, in an order that rotates from round to round, each
in a fresh process that starts its broker, runs the cells of the harness's full
profile named by `--cells` (the labels `bench-competitive/run.py` prints: `c1_b256`,
`c8_b256`, `c50_b256`, `c1_b64`, `c1_b1024`, `c1_b65536`, `lifecycle`, `multi`,
`latency`, `batched`) with the harness's own code, and stops it; the broker pinned to
CPU 0, the load generator to CPU 1, as `run.py` places them. Prints every round's
rates and the broker's and the load generator's CPU per job in each cell, then each
side's medians and its per-round ratio to the first side (and to RabbitMQ) with their
medians and ranges: on a shared host, ratios measured in the same round are what can
be compared, and a range that straddles 1 by far is no result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HARNESS = ROOT / "bench-competitive"
BROKER_CPU, CLIENT_CPU = 0, 1
DEFAULT_CELLS = "c1_b256,c8_b256,c50_b256,lifecycle,multi"
RABBITMQ = "rabbitmq"


def _one(broker: str, mode: str, labels: list[str]) -> dict[str, dict[str, float]]:
    """Runs the cells in this process (pinned by the caller); figures per row."""
    sys.path.insert(0, str(HARNESS))
    from competitive.adapters import load
    from competitive.cells import plan
    from competitive.procs import members, temp_dir
    from competitive.profile import FULL
    from competitive.resources import read_cpu_ticks

    cells = {cell.label: cell for cell in plan(FULL)}
    unknown = [label for label in labels if label not in cells]
    if unknown:
        raise SystemExit(f"unknown cells {unknown}; choose from {','.join(cells)}")
    ticks_per_s = os.sysconf("SC_CLK_TCK")

    async def run() -> dict[str, dict[str, float]]:
        figures: dict[str, dict[str, float]] = {}
        with temp_dir(f"ab-{broker}-{mode}") as workdir:
            adapter = load(broker)(mode, workdir, cpu=BROKER_CPU, instance=f"ab:{os.getpid()}")
            await adapter.start()
            try:
                assert adapter.process is not None
                pid = adapter.process.pid

                def ticks() -> int:
                    total = 0
                    for member in members(adapter.instance, pid):
                        with contextlib.suppress(OSError, ValueError, IndexError):
                            total += read_cpu_ticks(member)
                    return total

                for label in labels:
                    before, client_before = ticks(), time.process_time()
                    outcome = await cells[label].run(adapter, 1)
                    used = (ticks() - before) / ticks_per_s
                    client = time.process_time() - client_before
                    for m in outcome.measurements:
                        if m.value is None or m.status != "ok":
                            raise SystemExit(f"{label}: {m.key.workload}: {m.status}")
                        figures[f"{label}:{m.key.workload}"] = {"value": m.value}
                    if outcome.jobs:
                        per_job = 1e6 / outcome.jobs
                        figures[f"{label}:cpu_us_per_job"] = {"value": used * per_job}
                        figures[f"{label}:client_cpu_us_per_job"] = {"value": client * per_job}
            finally:
                await adapter.stop()
        return figures

    return asyncio.run(run())


def _side(name: str, path: str, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if path:
        env["PYTHONPATH"] = path
    broker = RABBITMQ if name == RABBITMQ else "fila"
    command = [
        "taskset", "-c", str(CLIENT_CPU), sys.executable, __file__,
        "--one", broker, "--mode", args.mode, "--cells", args.cells,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"side {name} failed:\n{done.stdout}\n{done.stderr}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    return {row: float(v["value"]) for row, v in figures.items()}


def _ratio(a: list[float], b: list[float]) -> str:
    """The median of the same-round ratios a/b and, in brackets, their range: on a
    noisy host a median of 1.05 whose rounds run from 0.8 to 1.4 says nothing."""
    ratios = [x / y for x, y in zip(a, b, strict=True) if y]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", action="append", default=[], help="NAME=PYTHONPATH")
    parser.add_argument("--rabbitmq", action="store_true")
    parser.add_argument("--cells", default=DEFAULT_CELLS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("durable", "buffered"), default="durable")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        labels = [c for c in args.cells.split(",") if c]
        print(json.dumps(_one(args.one, args.mode, labels)), flush=True)
        return 0
    sides = [tuple(s.split("=", 1)) if "=" in s else (s, "") for s in args.side]
    if args.rabbitmq:
        sides.append((RABBITMQ, ""))
    if not sides:
        parser.error("give at least one --side or --rabbitmq")
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in sides}
    for index in range(args.rounds):
        shift = index % len(sides)
        order = sides[shift:] + sides[:shift]
        for name, path in order:
            figures = _side(name, path, args)
            results[name].append(figures)
            shown = ", ".join(f"{row} {value:,.0f}" for row, value in figures.items())
            print(f"round {index + 1} {name}: {shown}", flush=True)
    rows = list(results[sides[0][0]][0])
    first = sides[0][0]
    print(
        f"\nmedians of {args.rounds} rounds; ratios are medians of same-round ratios, [their range]"
    )
    for row in rows:
        line = [f"{row:28}"]
        for name, _ in sides:
            values = [r[row] for r in results[name]]
            line.append(f"{name} {statistics.median(values):9,.1f}")
            if name != first:
                base = [r[row] for r in results[first]]
                line.append(f"/{first} {_ratio(values, base)}")
            if RABBITMQ in results and name != RABBITMQ:
                rabbit = [r[row] for r in results[RABBITMQ]]
                line.append(f"/rabbitmq {_ratio(values, rabbit)}")
        print("  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
