"""Gives freed heap memory back to the operating system, periodically.

glibc keeps memory a process freed in its arenas for reuse, and returns it only
from the top of the heap: after a burst (a backlog drained, stalled streams
cancelled, a large batch decoded) the broker's RSS stays where the burst left it.
Measured here: 218 MiB holding a million ready messages after ingesting them, 140
MiB after `malloc_trim(0)`. A thread of its own calls it every `interval_s`;
ctypes releases the GIL for the call, so the event loop keeps serving. Where the
C library is not glibc there is no `malloc_trim`, and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("fila.server")

TRIM_INTERVAL_S = 30.0


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


class HeapTrimmer:
    """Owned by `serve`: `start()` after startup, `stop()` at shutdown."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S) -> None:
        self._interval_s = interval_s
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
        trim = self._trim
        assert trim is not None
        while not self._stop.wait(self._interval_s):
            trim(0)
