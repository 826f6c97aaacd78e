#!/usr/bin/env python3
"""The blocking `fila_sdk.Client`'s per-call cost: this tree's SDK against another commit's.

    .venv/bin/python scripts/sdk_latency.py [--baseline main] [--runs 5] [--calls 300]

One broker serves every measurement. The baseline SDK is `git archive`d from
`--baseline` into a temporary directory as the package `fila_sdk_baseline` (the SDK
imports itself only relatively), and each run measures the two in turn, each in a
fresh child process, their order alternating from run to run so that the shared
machine's drift falls on both alike. The report gives, per figure, the median of the
runs for each and their ratio (current / baseline).

Figures, from one thread unless said:
- `ack_us`: the median latency of `Client.ack` on a leased message (a unary call that
  waits for the broker's group commit);
- `get_stats_us`: the median latency of `Client.get_stats` (a unary admin call that
  touches no storage: the SDK's own overhead shows most here);
- `enqueue_us`: the median latency of `Client.enqueue` (the stream path, through the
  client's private loop thread);
- `enqueue_8t_per_s`: messages per second that 8 threads sharing one client enqueue;
- `get_stats_loop_us`, `ack_loop_us`: the same calls made the other way a blocking
  client could make them, as `AsyncClient` calls run on the client's private loop
  thread (`Client.streams()`) from the calling thread: what a sync client that is a
  thin layer over the async one would cost per call.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIGURES = (
    "ack_us",
    "get_stats_us",
    "enqueue_us",
    "enqueue_8t_per_s",
    "ack_loop_us",
    "get_stats_loop_us",
)


def _median_us(call: Callable[[], object], count: int) -> float:
    times = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def measure(package: str, addr: str, calls: int) -> dict[str, float]:
    """The figures for the SDK importable as `package`, against the broker at `addr`."""
    sdk: Any = importlib.import_module(package)
    queue = f"latency-{package}"
    with sdk.Client(addr) as client:
        client.create_queue(queue, exist_ok=True)
        client.purge(queue)
        for _ in range(20):  # warm up: connections, the loop thread, the stream
            client.enqueue(queue, b"w")
            client.get_stats(queue)
        client.purge(queue)
        figures = {"get_stats_us": _median_us(lambda: client.get_stats(queue), calls)}
        figures["enqueue_us"] = _median_us(lambda: client.enqueue(queue, b"x"), calls)
        client.purge(queue)
        client.enqueue_many(queue, [b"a"] * calls)
        stream = client.consume(queue, prefetch=calls)
        acks = []
        for _ in range(calls):
            message_id = next(stream).id
            started = time.perf_counter()
            client.ack(queue, message_id)
            acks.append(time.perf_counter() - started)
        stream.close()
        figures["ack_us"] = statistics.median(acks) * 1e6
        loop, twin = client.streams()
        figures["get_stats_loop_us"] = _median_us(lambda: loop.run(twin.get_stats(queue)), calls)
        client.enqueue_many(queue, [b"b"] * calls)
        stream = client.consume(queue, prefetch=calls)
        acks = []
        for _ in range(calls):
            message_id = next(stream).id
            started = time.perf_counter()
            loop.run(twin.ack(queue, message_id))
            acks.append(time.perf_counter() - started)
        stream.close()
        figures["ack_loop_us"] = statistics.median(acks) * 1e6
        per_thread = calls * 4 // 8

        def produce() -> None:
            for _ in range(per_thread):
                client.enqueue(queue, b"t")

        threads = [threading.Thread(target=produce) for _ in range(8)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        figures["enqueue_8t_per_s"] = 8 * per_thread / (time.perf_counter() - started)
        client.purge(queue)
    return figures


def _baseline_package(rev: str, into: Path) -> None:
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "fila_sdk"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    (into / "fila_sdk").rename(into / "fila_sdk_baseline")


def _child(package: str, addr: str, calls: int, path: Path) -> dict[str, float]:
    code = (
        f"import sys, json; sys.path[:0] = [{str(path)!r}, {str(REPO)!r}, "
        f"{str(REPO / 'scripts')!r}]; import sdk_latency; "
        f"print(json.dumps(sdk_latency.measure({package!r}, {addr!r}, {calls})))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="main", help="git revision of the baseline SDK")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300, help="calls per figure and run")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from fila.testing.server import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _baseline_package(args.baseline, root)
        results: dict[str, dict[str, list[float]]] = {"fila_sdk_baseline": {}, "fila_sdk": {}}
        with ServerProcess(root / "data") as server:
            for run in range(args.runs):
                order = list(results) if run % 2 == 0 else list(reversed(results))
                for package in order:
                    figures = _child(package, server.addr, args.calls, root)
                    for name, value in figures.items():
                        results[package].setdefault(name, []).append(value)
                print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    print(f"baseline {args.baseline}, {args.runs} runs, {args.calls} calls per figure\n")
    print("| figure | baseline | this tree | ratio | runs (baseline; this tree) |")
    print("|---|---|---|---|---|")
    for name in FIGURES:
        base = results["fila_sdk_baseline"][name]
        ours = results["fila_sdk"][name]
        b, o = statistics.median(base), statistics.median(ours)
        runs = f"{', '.join(f'{v:.0f}' for v in base)}; {', '.join(f'{v:.0f}' for v in ours)}"
        print(f"| {name} | {b:,.0f} | {o:,.0f} | {o / b:.2f} | {runs} |")


if __name__ == "__main__":
    main()
