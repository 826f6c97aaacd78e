"""Signals for `fila-server` (docs/operations.md, "Exit codes and signals").

SIGTERM, SIGINT and SIGHUP (a closed terminal; some supervisors) stop the broker
gracefully once it serves. Before that, while storage opens and recovery runs, one of
them ends the process at once with one line and exit code 0 (`_abandon_startup`):
nothing was served, and nothing the interrupted start did needs undoing, since the
store recovers from any point as it does from a crash, and recovery writes its
repairs in one batch at its end. Raising instead (Python's KeyboardInterrupt) would
surface wherever recovery was, and unwinding through asyncio and gRPC prints a long
traceback. SIGUSR1 and SIGUSR2, whose default action would kill the broker with no
drain and no log line, are ignored with a warning. SIGQUIT keeps its default (a core
dump is what it asks for).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from fila.server.startup import ExitCode

log = logging.getLogger("fila.server")

# Stop the broker (see the module docstring).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# No meaning for fila-server: ignored, with a warning, rather than fatal.
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def _abandon_startup(signum: int, frame: object) -> None:
    """A stop signal before the broker serves: one line, exit 0, nothing more run.

    `os._exit`, not an exception: no code of the interrupted start (a recovery
    half-way through its scan, its writes still pending) runs after this, and nothing
    is written; what is on disk is what was there, which the next start recovers."""
    name = signal.Signals(signum).name
    os.write(
        sys.stderr.fileno(),
        f"fila-server: stopped by {name} while starting, before serving; stored data is "
        "as it was\n".encode(),
    )
    os._exit(ExitCode.OK)


def _ignore_signal(signum: int, frame: object = None) -> None:
    log.warning(
        "ignored %s: it has no meaning for fila-server (SIGTERM, SIGINT or SIGHUP stop it)",
        signal.Signals(signum).name,
    )


@contextmanager
def startup_signals() -> Iterator[None]:
    """Stop signals end a start at once until `serving_signals` takes them; after the
    block (the loop closed: the broker stopped, or never started) they are ignored,
    since a late one changes nothing."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _abandon_startup)
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, _ignore_signal)
    try:
        yield
    finally:
        for sig in (*STOP_SIGNALS, *IGNORED_SIGNALS):
            signal.signal(sig, signal.SIG_IGN)


def serving_signals(stop: asyncio.Event) -> list[str]:
    """Hands the signals to the running loop: a stop signal now sets `stop` (a graceful
    stop, carried out as soon as the broker serves). Returns the list the names of the
    signals that asked for it are appended to."""
    loop = asyncio.get_running_loop()
    stopped_by: list[str] = []

    def stop_requested(sig: signal.Signals) -> None:
        stopped_by.append(sig.name)
        stop.set()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop_requested, sig)
    for sig in IGNORED_SIGNALS:
        loop.add_signal_handler(sig, _ignore_signal, sig)
    return stopped_by
