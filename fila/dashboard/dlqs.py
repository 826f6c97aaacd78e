"""Dead-letter queue naming: `orders` dead-letters into `orders.dlq` (SPEC 2)."""

from __future__ import annotations

from typing import Final

DLQ_SUFFIX: Final = ".dlq"


def dlq_of(queue: str) -> str:
    return queue + DLQ_SUFFIX


def parent_of(name: str) -> str | None:
    """The queue `name` is the dead-letter queue of, if it looks like one."""
    if name.endswith(DLQ_SUFFIX) and len(name) > len(DLQ_SUFFIX):
        return name[: -len(DLQ_SUFFIX)]
    return None
