"""SIGINT and SIGTERM stop a running worker (main thread only)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Final

log = logging.getLogger("fila_sdk")

_STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_call(
    stop: Callable[[], None], loop: asyncio.AbstractEventLoop | None, *, sync: bool = False
) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM call `stop` (through `loop` when given, else
    with `signal.signal` when `sync`); only possible in the main thread."""
    if threading.current_thread() is not threading.main_thread() or (loop is None and not sync):
        yield
        return
    if loop is not None:
        for signum in _STOP_SIGNALS:
            loop.add_signal_handler(signum, stop)
        try:
            yield
        finally:
            for signum in _STOP_SIGNALS:
                loop.remove_signal_handler(signum)
        return
    previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}

    def on_signal(signum: int, frame: object) -> None:
        log.info("worker stopping on signal %s", signal.Signals(signum).name)
        stop()

    for signum in _STOP_SIGNALS:
        signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
