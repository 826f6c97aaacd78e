#!/usr/bin/env python3
"""What the commit's hand-off to the fsync thread costs in CPU, in one process.

    .venv/bin/python scripts/commit_handoff.py [--cycles 20000] [--rounds 3] [--cpu 1]

Two measures, each the process's CPU time (every thread) per cycle, rounds alternating,
medians printed:

- a bare round trip from the event loop to a thread and back: `queue` is the
  committer's way (`SimpleQueue.put` wakes the thread, `call_soon_threadsafe` answers);
  `eventfd` wakes each side with an eventfd write (the loop reads its eventfd through
  `add_reader`); `none` resolves the future on the loop itself, no thread;
- the core's own enqueue of one message and its commit, one at a time, through the
  broker over in-memory storage (`tests/support/core.py`): in `buffer` mode the commit
  never leaves the loop; in `sync` mode it goes through the fsync thread, whose sync
  does nothing here, so the difference between the two is the hand-off alone.

Pinned to one CPU (`--cpu`, -1: not pinned), as the competitive harness pins the
broker. docs/benchmarks.md has what it showed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the in-memory core the core tests use

from support.core import make_core  # noqa: E402

from fila.v1 import service_pb2  # noqa: E402

PAYLOAD = b"x" * 256
Measure = Callable[[int], Awaitable[float]]


async def _cpu_per_round_trip(cycles: int, send: Callable[[asyncio.Future[None]], None]) -> float:
    """CPU per cycle of: a new future handed to `send`, awaited until someone resolves it."""
    loop = asyncio.get_running_loop()
    started = time.process_time()
    for _ in range(cycles):
        future = loop.create_future()
        send(future)
        await future
    return (time.process_time() - started) / cycles


async def round_trip_queue(cycles: int) -> float:
    loop = asyncio.get_running_loop()
    requests: queue.SimpleQueue[asyncio.Future[None] | None] = queue.SimpleQueue()

    def worker() -> None:
        while (future := requests.get()) is not None:
            loop.call_soon_threadsafe(future.set_result, None)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    used = await _cpu_per_round_trip(cycles, requests.put)
    requests.put(None)
    thread.join()
    return used


async def round_trip_eventfd(cycles: int) -> float:
    loop = asyncio.get_running_loop()
    to_thread, to_loop = os.eventfd(0), os.eventfd(0, os.EFD_NONBLOCK)
    waiting: list[asyncio.Future[None]] = []
    stop = False

    def worker() -> None:
        while True:
            os.eventfd_read(to_thread)
            if stop:
                return
            os.eventfd_write(to_loop, 1)

    def answered() -> None:
        os.eventfd_read(to_loop)
        waiting.pop().set_result(None)

    def send(future: asyncio.Future[None]) -> None:
        waiting.append(future)
        os.eventfd_write(to_thread, 1)

    loop.add_reader(to_loop, answered)
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    used = await _cpu_per_round_trip(cycles, send)
    stop = True
    os.eventfd_write(to_thread, 1)
    thread.join()
    loop.remove_reader(to_loop)
    os.close(to_thread)
    os.close(to_loop)
    return used


async def round_trip_none(cycles: int) -> float:
    loop = asyncio.get_running_loop()
    return await _cpu_per_round_trip(cycles, lambda future: loop.call_soon(future.set_result, None))


def core_cycle(persist_mode: str) -> Measure:
    async def measure(cycles: int) -> float:
        core = make_core(persist_mode=persist_mode, queues=["q"])
        enqueue = core.broker.enqueue
        started = time.process_time()
        for _ in range(cycles):
            _, committed = enqueue([service_pb2.EnqueueRequest(queue="q", payload=PAYLOAD)])
            await committed
        used = time.process_time() - started
        core.committer.close()
        return used / cycles

    return measure


MEASURES: dict[str, Measure] = {
    "round trip, queue + call_soon_threadsafe": round_trip_queue,
    "round trip, eventfd both ways": round_trip_eventfd,
    "round trip, no thread": round_trip_none,
    "core enqueue + commit, buffer": core_cycle("buffer"),
    "core enqueue + commit, sync (no-op sync)": core_cycle("sync"),
}


async def run(cycles: int, rounds: int) -> dict[str, list[float]]:
    seen: dict[str, list[float]] = {name: [] for name in MEASURES}
    names = list(MEASURES)
    for round_ in range(rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            seen[name].append(await MEASURES[name](cycles) * 1e6)
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", type=int, default=1, help="CPU to pin to; -1: not pinned")
    args = parser.parse_args()
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    seen = asyncio.run(run(args.cycles, args.rounds))
    where = f"pinned to CPU {args.cpu}" if args.cpu >= 0 else "not pinned"
    print(f"CPU per cycle, µs, {where}; median of {args.rounds} [each round]")
    for name, values in seen.items():
        rounds = ", ".join(f"{v:.1f}" for v in values)
        print(f"  {name:42s} {statistics.median(values):7.1f}  [{rounds}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
