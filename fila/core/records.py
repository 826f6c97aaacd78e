"""Per-message records the scheduler keeps in memory.

Only what scheduling needs lives here; headers and payload stay in RocksDB and
are read once, at delivery. Slotted classes because there is one `MessageRef`
per stored message.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fila.core.consumer import Consumer


class MessageRef:
    __slots__ = ("attempt_count", "fairness_key", "id", "key", "throttle_keys", "weight")

    def __init__(
        self,
        key: bytes,
        message_id: str,
        fairness_key: str,
        weight: int,
        throttle_keys: tuple[str, ...],
        attempt_count: int,
    ) -> None:
        self.key = key
        self.id = message_id
        self.fairness_key = fairness_key
        self.weight = weight
        self.throttle_keys = throttle_keys
        self.attempt_count = attempt_count


class Lease:
    """A delivered (or about to be delivered) message awaiting ack, nack or expiry.

    `record` is the stored `fila.v1.Message` bytes read at delivery, kept so
    that a nack or an expiry can rewrite the record without reading it again.
    `active` turns false when the lease ends, which is how a stale timer entry
    or an unsent copy in a consumer's buffer knows to do nothing.
    """

    __slots__ = ("active", "consumer", "deadline_ms", "leased_at_ms", "record", "ref", "sent")

    def __init__(
        self,
        ref: MessageRef,
        record: bytes,
        deadline_ms: int,
        leased_at_ms: int,
        consumer: Consumer | None,
    ) -> None:
        self.ref = ref
        self.record = record
        self.deadline_ms = deadline_ms
        self.leased_at_ms = leased_at_ms
        self.consumer = consumer
        self.active = True
        self.sent = False
