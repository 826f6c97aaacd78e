"""Gives freed heap memory back to the operating system, periodically.

glibc keeps memory a process freed in its arenas for reuse, and returns it only
from the top of the heap: after a burst (a backlog drained, stalled streams
cancelled, a large batch decoded) the broker's RSS stays where the burst left it,
and `malloc_trim(0)` gives a large part of it back (figures: docs/benchmarks.md,
"Measurements behind design choices"). A thread of its own looks every `interval_s`;
ctypes releases the GIL for the call, so the event loop keeps serving.

A trim is not free: it walks the heap's free chunks holding the arena's lock, so
every allocation waits, long on a fragmented heap and briefly on a tidy one. So it
trims only while the resident size (read from /proc/self/statm, which costs
microseconds) is `growth_bytes` above the lowest a trim has left it, and a trim that
gives back little doubles the wait before the next (up to `MAX_BACKOFF_S`): memory
still in use (a backlog that is still there) costs a stall every half hour at most,
memory freed later is still returned. Where the C library is not glibc there is no
`malloc_trim`, and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable

log = logging.getLogger("fila.server")

TRIM_INTERVAL_S = 30.0
TRIM_GROWTH_BYTES = 64 * 1024 * 1024
MAX_BACKOFF_S = 1800.0
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """This process's resident set size, from /proc/self/statm (0 where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except OSError:
        return 0


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    result: Callable[[int], int] = trim
    return result


class TrimPolicy:
    """When to trim, and what a trim earned: the state the trimmer's thread steps.

    Kept apart from the thread so a test can step it at chosen moments: a thread
    that trims on its own schedule may trim between any two lines of a test.
    """

    def __init__(self, trim: Callable[[int], int], interval_s: float, growth_bytes: int) -> None:
        self._trim = trim
        self._interval_s = interval_s
        self._growth_bytes = growth_bytes
        self._floor = resident_bytes()
        self.wait_s = interval_s

    def step(self) -> None:
        """Trim if the resident size grew `growth_bytes` above the floor; set `wait_s`."""
        before = resident_bytes()
        if before - self._floor < self._growth_bytes:
            self.wait_s = self._interval_s
            return
        self._trim(0)
        after = resident_bytes()
        self._floor = min(self._floor, after)
        gave_back = before - after >= self._growth_bytes // 4
        self.wait_s = self._interval_s if gave_back else min(2 * self.wait_s, MAX_BACKOFF_S)


class HeapTrimmer:
    """Owned by `serve`: `start()` after startup, `stop()` at shutdown."""

    def __init__(
        self, interval_s: float = TRIM_INTERVAL_S, growth_bytes: int = TRIM_GROWTH_BYTES
    ) -> None:
        self._interval_s = interval_s
        self._growth_bytes = growth_bytes
        self._trim = _malloc_trim()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fila-heap-trim", daemon=True)

    def start(self) -> None:
        if self._trim is not None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        assert self._trim is not None
        policy = TrimPolicy(self._trim, self._interval_s, self._growth_bytes)
        while not self._stop.wait(policy.wait_s):
            policy.step()
