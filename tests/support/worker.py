"""What the Worker tests share: their deadline, names, and waits on a queue's counts."""

from __future__ import annotations

from collections.abc import Callable

from fila_sdk import Client
from support import until as poll_until
from support import wait_until

DEADLINE_S = 15.0


async def until(predicate: object, what: str, within: float = DEADLINE_S) -> None:
    await poll_until(predicate, what, within)  # type: ignore[arg-type]


def wait(predicate: Callable[[], object], what: str, timeout: float = DEADLINE_S) -> None:
    wait_until(predicate, timeout, what=what)


def counts(c: Client, name: str) -> tuple[int, int]:
    """The queue's (depth, in_flight)."""
    stats = c.get_stats(name)
    return stats.depth, stats.in_flight
