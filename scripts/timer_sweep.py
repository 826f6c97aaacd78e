#!/usr/bin/env python3
"""The longest loop turn of the timer heap's cleanup, against rebuilding it at once.

    .venv/bin/python scripts/timer_sweep.py [--entries 1000000] [--reps 3]

Fills `fila.core.timers.Timers` with `--entries` entries, every other one dead (an
acked message's lease), then times: the rebuild the heap had until issue 29's last
stop (keep the live entries, heapify: one turn), and the sweep that replaced it
(`SWEEP_SLICE` entries a turn), slice by slice. Prints the best of `--reps` for each:
the longest turn, the total, and the entries left.
"""

from __future__ import annotations

import argparse
import heapq
import time
from typing import Any

from fila.clock import ManualClock
from fila.core.timers import Timers


def filled(entries: int, is_live: Any) -> Timers:
    timers = Timers(ManualClock(), is_live, loop_driven=False)
    timers._sweep_above = entries + 1  # filled first, swept when timed
    due = timers._clock.now_ms() + 600_000
    for n in range(entries):
        timers.at(due + n % 5000, lambda _subject: None, n)
    return timers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dead = set(range(0, args.entries, 2))

    def is_live(subject: int) -> bool:
        return subject not in dead

    rebuild: list[tuple[float, int]] = []
    sweep: list[tuple[float, float, int, int]] = []
    for _ in range(args.reps):
        timers = filled(args.entries, is_live)
        heap = timers._heap
        started = time.perf_counter()
        kept = [entry for entry in heap if is_live(entry[3])]
        heapq.heapify(kept)
        rebuild.append((time.perf_counter() - started, len(kept)))

        timers = filled(args.entries, is_live)
        turns: list[float] = []
        started = time.perf_counter()
        timers._start_sweep()  # not loop-driven: run_due drives the slices
        while timers.sweeping:
            turn = time.perf_counter()
            timers._sweep_slice()
            turns.append(time.perf_counter() - turn)
        sweep.append((max(turns), time.perf_counter() - started, len(turns), len(timers)))
    took, left = min(rebuild)
    print(f"rebuild at once: one turn of {took * 1e3:.1f} ms, {left:,} entries left")
    longest, total, count, left = min(sweep)
    print(
        f"sweep: longest turn {longest * 1e3:.1f} ms, {total * 1e3:.0f} ms in all over "
        f"{count:,} turns, {left:,} entries left"
    )


if __name__ == "__main__":
    main()
