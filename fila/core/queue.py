"""One queue's live state: its ready messages (DRR), leases, delayed retries, consumers.

Owned and mutated only by the `Broker`, on the event loop.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import asdict, dataclass

from fila.core.consumer import Consumer
from fila.core.drr import Drr
from fila.core.errors import InvalidArgument
from fila.core.records import Lease, MessageRef
from fila.lua.hooks import QueueHooks

DLQ_SUFFIX = ".dlq"
MAX_QUEUE_NAME = 255
_NAME_RE = re.compile(r"[A-Za-z0-9._:\-]+")


def validate_queue_name(name: str) -> None:
    """Refuses empty, over-long or malformed names with a reason naming the name."""
    if not name:
        raise InvalidArgument("queue name must not be empty")
    limit = MAX_QUEUE_NAME + len(DLQ_SUFFIX) if name.endswith(DLQ_SUFFIX) else MAX_QUEUE_NAME
    if len(name) > limit:
        raise InvalidArgument(
            f"queue name is {len(name)} characters, the limit is {MAX_QUEUE_NAME}"
        )
    if not _NAME_RE.fullmatch(name):
        raise InvalidArgument(f'queue name "{name}" may only contain letters, digits and . _ - :')


@dataclass(frozen=True, slots=True)
class QueueRecord:
    """What is persisted about a queue (its messages are stored separately)."""

    name: str
    on_enqueue_script: str = ""
    on_failure_script: str = ""
    visibility_timeout_ms: int = 30_000
    dlq_of: str = ""
    created_at_ms: int = 0

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> QueueRecord:
        return cls(**json.loads(raw))


class Queue:
    __slots__ = (
        "consumers",
        "delayed",
        "deleted",
        "drr",
        "hooks",
        "in_limbo",
        "leases",
        "record",
        "throttle_wake_ms",
        "waiting",
    )

    def __init__(self, record: QueueRecord, hooks: QueueHooks | None, quantum: int) -> None:
        self.record = record
        self.hooks = hooks
        self.drr = Drr(quantum)
        self.leases: dict[str, Lease] = {}
        self.delayed: dict[str, MessageRef] = {}
        self.consumers: dict[int, Consumer] = {}
        # Consumers with room in their buffer, served round-robin.
        self.waiting: deque[Consumer] = deque()
        # Messages whose write is not yet committed; they become ready once it is.
        self.in_limbo = 0
        self.deleted = False
        self.throttle_wake_ms: int | None = None

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def dlq_name(self) -> str | None:
        return None if self.record.dlq_of else self.record.name + DLQ_SUFFIX

    @property
    def depth(self) -> int:
        return self.drr.ready_count + len(self.delayed) + self.in_limbo
