"""One queue's live state: ready messages (DRR), leases, delayed messages, consumers.

Owned and mutated only by the `Broker`, on the event loop, through the methods of
the parts: `Drr` for ready messages, `LeaseTable` for leases, `ConsumerRing` for
consumers. `delayed` (stored, ready later) and `limbo` (written, waiting for the
commit that makes them deliverable) are plain maps the broker's primitives own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import MISSING, asdict, dataclass, fields

from fila.core.consumers import ConsumerRing
from fila.core.drr import Drr, FairnessKey
from fila.core.errors import InvalidArgument, clip
from fila.core.key_order import KeyOrder
from fila.core.leases import LeaseTable
from fila.core.records import MessageRef
from fila.core.stats import MAX_TRACKED_KEYS, QueueCounters
from fila.lua.hooks import QueueHooks
from fila.storage.committer import Committer
from fila.telemetry.histogram import DELIVERY_LATENCY_BOUNDS_MS, FixedHistogram
from fila.wire import DLQ_SUFFIX, dlq_name

MAX_QUEUE_NAME = 255
DEFAULT_VISIBILITY_TIMEOUT_MS = 30_000
MAX_VISIBILITY_TIMEOUT_MS = 7 * 24 * 3600 * 1000
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
        raise InvalidArgument(
            f'queue name "{clip(name)}" may only contain letters, digits and . _ - :'
        )
    if name in (".", ".."):
        # path segments every URL client folds away: the dashboard could not address it
        raise InvalidArgument(f'queue name "{name}" is reserved ("." and ".." are path steps)')


@dataclass(frozen=True, slots=True)
class QueueRecord:
    """What is persisted about a queue (its messages are stored separately).

    `max_attempts` (0 = no limit) and `retry_backoff` are the retry policy of a queue
    without an `on_failure` hook (`fila.core.retry`); a record stored before they
    existed reads as no limit and "none", so such a queue behaves as it did."""

    name: str
    on_enqueue_script: str = ""
    on_failure_script: str = ""
    visibility_timeout_ms: int = 30_000
    dlq_of: str = ""
    created_at_ms: int = 0
    max_attempts: int = 0
    retry_backoff: str = "none"

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> QueueRecord:
        """The stored record; raises ValueError unless every field has its type.

        Keys this version does not know are ignored (a later version's additions)."""
        stored = json.loads(raw)
        if not isinstance(stored, dict):
            raise ValueError("a queue record is a JSON object")
        values: dict[str, object] = {}
        for spec in fields(cls):
            if spec.name not in stored:
                if spec.default is MISSING:
                    raise ValueError(f"a queue record needs {spec.name!r}")
                continue
            value = stored[spec.name]
            expected = str if spec.default is MISSING else type(spec.default)
            if type(value) is not expected:
                raise ValueError(f"{spec.name!r} is {value!r}, not a {expected.__name__}")
            values[spec.name] = value
        return cls(**values)  # type: ignore[arg-type]


class DelayedMessages:
    """A queue's delayed messages (stored, ready later) by storage key, and their key
    order for peek (`KeyOrder`). Changed only through these methods, so the order
    cannot drift from the map."""

    __slots__ = ("_order", "_refs")

    def __init__(self) -> None:
        self._refs: dict[bytes, MessageRef] = {}
        self._order = KeyOrder(self._refs)

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, key: bytes) -> bool:
        return key in self._refs

    def get(self, key: bytes) -> MessageRef | None:
        return self._refs.get(key)

    def __setitem__(self, key: bytes, ref: MessageRef) -> None:
        new = key not in self._refs
        self._refs[key] = ref
        if new:
            self._order.added(key)

    def __delitem__(self, key: bytes) -> None:
        del self._refs[key]
        self._order.removed(key)

    def drain(self) -> Iterator[MessageRef]:
        """Takes the messages out one at a time as the caller iterates, so that a
        million of them are freed along the way rather than all in one turn at the end."""
        refs, order = self._refs, self._order
        while refs:
            key, ref = refs.popitem()
            order.removed(key)
            yield ref

    def iter_from(self, after: bytes) -> Iterator[MessageRef]:
        """The delayed messages with a key above `after`, in key (id) order (do not
        change them while iterating)."""
        refs = self._refs
        for key in self._order.after(after):
            yield refs[key]


class Queue:
    __slots__ = (
        "consumers",
        "counters",
        "delayed",
        "deleted",
        "drr",
        "hooks",
        "key_deliveries",
        "latency",
        "leases",
        "limbo",
        "record",
        "throttle_wake_ms",
        "throttle_wakes",
    )

    def __init__(
        self,
        record: QueueRecord,
        hooks: QueueHooks | None,
        quantum: int,
        committer: Committer,
        schedule_expiry: Callable[[Queue, int], None],
        mark_dirty: Callable[[Queue], None],
    ) -> None:
        self.record = record
        self.hooks = hooks
        self.drr = Drr(quantum)
        self.consumers = ConsumerRing()
        self.leases = LeaseTable(
            self.consumers,
            committer,
            lambda deadline_ms: schedule_expiry(self, deadline_ms),
            lambda: mark_dirty(self),
            record.name,
        )
        self.delayed = DelayedMessages()
        self.limbo: dict[bytes, MessageRef] = {}
        self.deleted = False
        self.throttle_wake_ms: int | None = None
        # (due ms, seq, key): when each parked fairness key's tokens can be there.
        self.throttle_wakes: list[tuple[int, int, FairnessKey]] = []
        self.counters = QueueCounters()
        self.key_deliveries: dict[str, int] = {}
        # Enqueue-to-first-delivery latency (ms), exported as fila.delivery.latency.
        self.latency = FixedHistogram(DELIVERY_LATENCY_BOUNDS_MS)

    @property
    def name(self) -> str:
        return self.record.name

    def detach_delayed(self) -> Iterator[MessageRef]:
        """Takes every delayed message out at once, in O(1) (see `fila.core.removal`);
        their timers find them gone (`CoreState.release_delayed`). The detached ones
        are handed over one by one, each let go as the next is asked for."""
        detached = self.delayed
        self.delayed = DelayedMessages()
        return detached.drain()

    @property
    def dlq_name(self) -> str | None:
        return None if self.record.dlq_of else dlq_name(self.record.name)

    @property
    def depth(self) -> int:
        """Ready + delayed messages, including those whose write is being committed."""
        return self.drr.ready_count + len(self.delayed) + len(self.limbo)

    def count_delivery(self, ref: MessageRef, now_ms: int) -> None:
        self.counters.delivered += 1
        if not ref.attempt_count:  # a first delivery: time since enqueue, from the UUIDv7
            waited = now_ms - int.from_bytes(ref.key[1:7], "big")  # ids.enqueued_ms, inlined
            self.latency.record(waited if waited > 0 else 0)
        fairness_key = ref.fairness_key
        deliveries = self.key_deliveries
        count = deliveries.get(fairness_key)
        if count is not None:
            deliveries[fairness_key] = count + 1
        elif len(deliveries) < MAX_TRACKED_KEYS:
            deliveries[fairness_key] = 1
