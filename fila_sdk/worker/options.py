"""A worker's validated arguments, and the counters it keeps."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from .._channel import milliseconds


@dataclass(slots=True)
class WorkerStats:
    """Counters since the worker started (read them from the worker's loop or thread)."""

    delivered: int = 0
    """Messages received from the broker."""
    acked: int = 0
    """Messages whose handler returned."""
    nacked: int = 0
    """Messages whose handler raised."""
    released: int = 0
    """Messages given back unprocessed (stop, lost stream, handler past the grace period)."""
    extended: int = 0
    """Successful lease extensions."""
    resubscribed: int = 0
    """Streams opened again after one ended."""


@dataclass(frozen=True, slots=True)
class Options:
    """`Worker`'s arguments, checked once for both faces."""

    queue: str
    concurrency: int
    prefetch: int
    max_batch: int
    visibility_timeout_s: float | None
    grace_period_s: float

    @classmethod
    def build(
        cls,
        queue: str,
        concurrency: int,
        prefetch: int | None,
        max_batch: int | None,
        visibility_timeout: timedelta | float | None,
        grace_period: timedelta | float,
    ) -> Options:
        """Raises `ValueError` for a `concurrency` or `max_batch` below 1, a `prefetch`
        below `concurrency`, or a non-positive `visibility_timeout`."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        prefetch = 2 * concurrency if prefetch is None else prefetch
        if prefetch < concurrency:
            raise ValueError(f"prefetch ({prefetch}) must be at least concurrency ({concurrency})")
        max_batch = prefetch if max_batch is None else max_batch
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        timeout_s = None
        if visibility_timeout is not None:
            timeout_s = milliseconds(visibility_timeout, "visibility_timeout") / 1000
            if timeout_s <= 0:
                raise ValueError("visibility_timeout must be positive")
        grace_s = milliseconds(grace_period, "grace_period") / 1000
        return cls(queue, concurrency, prefetch, max_batch, timeout_s, grace_s)
