"""Streams waiting for their client's next request, interrupted when the broker stops.

A `StreamEnqueue` stays open between requests, often for the life of a producer:
the SDK keeps one per client. At shutdown the broker refuses new work, but gRPC's
graceful stop waits for every open call to end, so one idle producer held every
stop for the whole `shutdown_grace_ms` and then saw CANCELLED, which says nothing
about trying again. Interrupting the wait for the next request ends such a stream
at once, after the answers it owes, with UNAVAILABLE "broker is shutting down".

The interruption is a task cancellation, so reading costs nothing per request (a
race against a shutdown event would cost a task per request on the hot path). A
stream registers only while it awaits the next request; no other await can see
the shutdown's cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any


class StreamReaders:
    """The handler tasks now waiting for a request; the loop thread owns the set."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Task[Any]] = set()
        self._stopping = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Marks the current task as waiting for requests inside the block; the
        shutdown may cancel it there (see `interrupted`)."""
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            yield
        finally:
            self._waiting.discard(task)

    def interrupt(self) -> None:
        """At shutdown, after the broker refuses new work: wakes every stream waiting
        for a request."""
        self._stopping = True
        for task in self._waiting:
            task.cancel("broker is shutting down")

    def interrupted(self) -> bool:
        """Called where a reading task caught `CancelledError`: True if that was the
        shutdown's interruption alone, which it then withdraws so the stream can
        answer what it owes; False if the cancellation must propagate (the client
        went away, or gRPC cancels the call)."""
        task = asyncio.current_task()
        if not self._stopping or task is None or task.cancelling() != 1:
            return False
        task.uncancel()
        return True
