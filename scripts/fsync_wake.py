#!/usr/bin/env python3
"""How soon a woken fsync thread starts its sync while the event loop keeps the GIL.

    .venv/bin/python scripts/fsync_wake.py [--rounds 2000] [--busy-us 50] [--cpu 0]

The broker's loop hands each sync to its fsync thread and goes on with its turn.
The thread needs the GIL to start the sync (`flush_wal` releases it only once
running). This times, in one process shaped like that, the wake-up to the moment
the thread is past its GIL and "syncing" (a sleep of 200 µs that releases the GIL,
standing in for `flush_wal`), while the main thread spends `--busy-us` of pure
Python after waking it, as the rest of a loop turn does:

- `queue`: woken by `SimpleQueue.put`, which keeps the GIL while it wakes the thread;
- `pipe`: woken by `os.write` on a pipe the thread reads, which releases the GIL
  during the write, so the thread can take it then.

Each way runs twice, alternating; prints the medians and 90th percentiles. Pinned
to one CPU (`--cpu`, -1: not pinned) as the broker is in the competitive harness.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time

SYNC_S = 0.0002


def _spin(us: float) -> None:
    """Pure Python for about `us` microseconds (holds the GIL)."""
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def measure(way: str, rounds: int, busy_us: float) -> list[float]:
    """Seconds from each wake-up to the thread's sync starting."""
    requests: queue.SimpleQueue[bool] = queue.SimpleQueue()
    done: queue.SimpleQueue[float] = queue.SimpleQueue()
    read_fd, write_fd = os.pipe()

    def thread() -> None:
        while True:
            go = requests.get() if way == "queue" else os.read(read_fd, 1) == b"w"
            if not go:
                return
            started = time.perf_counter()
            time.sleep(SYNC_S)  # releases the GIL, as flush_wal does
            done.put(started)

    worker = threading.Thread(target=thread, daemon=True)
    worker.start()
    waits: list[float] = []
    for _ in range(rounds):
        woken = time.perf_counter()
        if way == "queue":
            requests.put(True)
        else:
            os.write(write_fd, b"w")
        _spin(busy_us)
        waits.append(done.get() - woken)
    if way == "queue":
        requests.put(False)
    else:
        os.write(write_fd, b"s")
    worker.join()
    os.close(read_fd)
    os.close(write_fd)
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--busy-us", type=float, default=50.0)
    parser.add_argument("--cpu", type=int, default=0)
    args = parser.parse_args()
    if args.cpu >= 0:
        os.sched_setaffinity(0, {args.cpu})
    for way in ("queue", "pipe", "queue", "pipe"):
        waits = sorted(measure(way, args.rounds, args.busy_us))
        p50, p90 = statistics.median(waits), waits[int(0.9 * len(waits))]
        print(f"{way:5}  wake to sync start: median {p50 * 1e6:6.1f} µs, p90 {p90 * 1e6:6.1f} µs")


if __name__ == "__main__":
    main()
