"""Per-message records the scheduler keeps in memory.

Only what scheduling needs lives here; id, headers and payload stay in storage
and are read once, at delivery. There is one `MessageRef` per stored message,
so it is slotted and small: the storage key doubles as the id (its 16 bytes are
the UUIDv7), and the fairness key and throttle keys are shared objects (see
`Drr.intern`), not per-message copies (figures: docs/benchmarks.md, "Measurements
behind design choices").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fila.core.consumers import Consumer


def message_id(key: bytes) -> str:
    """The canonical UUID string of a message key (`m` + 16 raw bytes)."""
    h = key[1:].hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class MessageRef:
    __slots__ = ("attempt_count", "fairness_key", "key", "throttle_keys", "weight")

    def __init__(
        self,
        key: bytes,
        fairness_key: str,
        weight: int,
        throttle_keys: tuple[str, ...],
        attempt_count: int,
    ) -> None:
        self.key = key
        self.fairness_key = fairness_key
        self.weight = weight
        self.throttle_keys = throttle_keys
        self.attempt_count = attempt_count

    @property
    def id(self) -> str:
        return message_id(self.key)


class Lease:
    """A delivered (or about to be delivered) message awaiting ack, nack or expiry.

    `active` turns false when the lease ends, which is how a stale timer entry or
    an unsent copy in a consumer's buffer knows to do nothing. `sent` turns true
    when the stream hands the message to gRPC; until then the lease can be given
    back without counting an attempt. Only `fila.core.leases` changes a lease.
    """

    __slots__ = ("active", "consumer", "deadline_ms", "leased_at_ms", "ref", "sent")

    def __init__(
        self,
        ref: MessageRef,
        deadline_ms: int,
        leased_at_ms: int,
        consumer: Consumer | None,
    ) -> None:
        self.ref = ref
        self.deadline_ms = deadline_ms
        self.leased_at_ms = leased_at_ms
        self.consumer = consumer
        self.active = True
        self.sent = False
