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


class Interrupted(Exception):
    """The broker's shutdown ended a stream's wait for its next request: the stream
    answers what it owes, then ends with UNAVAILABLE "broker is shutting down"."""


class StreamReaders:
    """The handler tasks now waiting for a request; the loop thread owns the set.

    A handler that is given none makes its own, which nothing interrupts (in cluster
    mode the service behind the splitter: the splitter is what reads the client)."""

    def __init__(self) -> None:
        self._waiting: set[asyncio.Task[Any]] = set()
        self._stopping = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Marks the current task as waiting for requests inside the block. The
        shutdown's cancellation, and only that, leaves the block as `Interrupted`;
        any other cancellation (the client went away, gRPC cancels the call)
        propagates."""
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self._stopping or task.cancelling() != 1:
                raise
            task.uncancel()  # withdrawn, so the stream can answer what it owes
            raise Interrupted from None
        finally:
            self._waiting.discard(task)

    def interrupt(self) -> None:
        """At shutdown, after the broker refuses new work: wakes every stream waiting
        for a request."""
        self._stopping = True
        for task in self._waiting:
            task.cancel("broker is shutting down")
