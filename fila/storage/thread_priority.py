"""A higher CPU priority for the thread every durable answer waits on.

In `sync` mode each answer waits for the committer's fsync thread: woken once a batch
is in the write-ahead log, it issues the fdatasync and hands the outcome back to the
event loop. It needs the CPU for microseconds at a time, but needs it at once. At the
process's own priority, on a core the event loop and gRPC keep busy, the scheduler
let it wait its turn: a sync timed from Python took far longer than the kernel's
fdatasync, and every answer of the group waited that much longer. Raised 15 nice
levels, most of that wait goes and durable enqueue comes closer to buffered (figures:
docs/benchmarks.md, "Measurements behind design choices"). It cannot starve the rest
of the broker: between its bursts it blocks on its queue or on the disk, and it uses
a small part of a core, most of that the kernel's fdatasync.

This is the other end of what `fila.storage.backend` does for RocksDB's flushes and
compactions, which run at the lowest priority so they yield to the WAL and requests.

Raising a priority needs privilege: CAP_SYS_NICE, or a nice limit (RLIMIT_NICE; under
systemd `LimitNICE=-15`, under Docker `--ulimit nice=35`). Without it the thread stays
at the broker's priority and says so once; nothing else changes. Only Linux gives
threads priorities of their own, so elsewhere nothing is attempted.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

NICE_MIN = -20  # the highest priority a nice value can name


@dataclass(frozen=True, slots=True)
class PriorityOutcome:
    """What `raise_current_thread` did: the nice values before and after, or why not."""

    before: int
    after: int
    refused: str = ""  # why the priority stayed as it was, if it was asked to change


def raise_current_thread(levels: int) -> PriorityOutcome:
    """Lowers the calling thread's nice value by `levels` (at most to -20), relative
    to its own, so a broker started with `nice` keeps its threads' order."""
    if not sys.platform.startswith("linux"):
        return PriorityOutcome(0, 0, "per-thread priorities are Linux-only")
    thread = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, thread)
    target = max(NICE_MIN, before - levels)
    if levels <= 0 or target == before:
        return PriorityOutcome(before, before)
    try:
        os.setpriority(os.PRIO_PROCESS, thread, target)
    except PermissionError:
        return PriorityOutcome(
            before,
            before,
            f"raising a thread's priority needs CAP_SYS_NICE or a nice limit of {target} "
            f"(RLIMIT_NICE; systemd LimitNICE={target})",
        )
    return PriorityOutcome(before, os.getpriority(os.PRIO_PROCESS, thread))
