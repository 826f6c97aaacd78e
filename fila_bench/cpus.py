"""Broker and load generator on separate CPUs, where the host allows it.

On a two-core machine the broker and the one Python process that generates load
otherwise trade places on both cores, and how they happen to share them moves every
throughput figure from run to run. Pinning gives the broker (and the echo server
that stands in for it when the ceiling is measured) its own CPU and the load
generator the rest, so each side gets the same CPU every run.

This is what `taskset -a -p` does, through the same system call: the affinity of a
process is per thread on Linux, so every thread the broker already has (gRPC's,
RocksDB's background jobs, the committer's fsync thread) is pinned one by one, and
threads it starts later inherit the mask of the thread that starts them. A host
that refuses (a container without the capability, a CPU set of one) runs unpinned,
and the results file says so (`environment.cpu_pinning`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class PinningError(ValueError):
    """A `--cpus` value that does not name two disjoint, usable CPU sets."""


@dataclass(frozen=True, slots=True)
class Placement:
    server: frozenset[int]  # the broker, and the echo server of the ceiling
    client: frozenset[int]  # this process: every producer and consumer

    def describe(self) -> str:
        return f"server {_fmt(self.server)}, load generator {_fmt(self.client)}"


def plan(spec: str) -> Placement | None:
    """`off`: no pinning. `auto`: the last usable CPU for servers, the others for the
    load generator (None when fewer than two are usable). `S:C`: explicit CPU lists,
    e.g. `1:0` or `2-3:0-1`."""
    usable = frozenset(os.sched_getaffinity(0))
    if spec == "off":
        return None
    if spec == "auto":
        if len(usable) < 2:
            return None
        last = max(usable)
        return Placement(frozenset({last}), usable - {last})
    server_text, sep, client_text = spec.partition(":")
    if not sep:
        raise PinningError(f"--cpus {spec!r}: expected auto, off or SERVER:CLIENT (e.g. 1:0)")
    server, client = _parse(server_text), _parse(client_text)
    if server & client:
        raise PinningError(f"--cpus {spec!r}: server and load generator CPUs overlap")
    if not (server | client) <= usable:
        raise PinningError(f"--cpus {spec!r}: this process may only use CPUs {_fmt(usable)}")
    return Placement(server, client)


def pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Every current thread of `pid` onto `cpus`; raises OSError where not allowed.

    Threads that exit between listing and pinning are skipped.
    """
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:
            continue


def _parse(text: str) -> frozenset[int]:
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise PinningError(f"bad CPU list {text!r}") from None
    if not cpus:
        raise PinningError(f"empty CPU list {text!r}")
    return frozenset(cpus)


def _fmt(cpus: frozenset[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
