"""Leases: the one module that starts, sends, extends and ends them.

A lease is in its queue's `LeaseTable` exactly while it is active, its consumer
counts it as unsettled exactly as long, and its storage record (deadline and
leased-at time, under the `l` prefix) exists exactly while it is active *and*
has been sent. Every way a lease begins or ends goes through this table, so
those three facts cannot drift apart.

The record is written when the stream hands the message to gRPC (`sent`), one
WAL append per frame, not when the message is queued for the stream: after a
crash, a message that never left the broker is ready at once and counts no
attempt, while one that left comes back as leased, with its deadline.

Expiry is bucketed by deadline millisecond: leases granted in the same
millisecond share one timer entry, and a lease leaves its bucket when it ends, so
the timer heap grows with distinct deadlines, not with messages, and holds no
settled lease.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from fila.core.consumers import Consumer, ConsumerRing
from fila.core.key_order import KeyOrder
from fila.core.records import Lease, MessageRef
from fila.storage import keys
from fila.storage.committer import Committer


class LeaseTable:
    __slots__ = (
        "_by_key",
        "_committer",
        "_expiring",
        "_on_room",
        "_order",
        "_queue",
        "_ring",
        "_schedule_expiry",
    )

    def __init__(
        self,
        ring: ConsumerRing,
        committer: Committer,
        schedule_expiry: Callable[[int], None],
        on_room: Callable[[], None],
        queue: str = "",
    ) -> None:
        """`queue`: the queue's name, which its lease records are written under
        (`Committer.put`)."""
        self._queue = queue or None
        self._by_key: dict[bytes, Lease] = {}
        self._order = KeyOrder(self._by_key)  # for peek: kept only while there are many
        # deadline ms -> the active leases due then (by message key)
        self._expiring: dict[int, dict[bytes, Lease]] = {}
        self._ring = ring
        self._committer = committer
        self._schedule_expiry = schedule_expiry
        self._on_room = on_room

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Lease]:
        return iter(self._by_key.values())

    def get(self, key: bytes) -> Lease | None:
        return self._by_key.get(key)

    def iter_from(self, after: bytes) -> Iterator[Lease]:
        """The leases of messages with a key above `after`, in key (id) order (peek; do
        not change the table while iterating)."""
        by_key = self._by_key
        for key in self._order.after(after):
            yield by_key[key]

    def grant(self, ref: MessageRef, consumer: Consumer, now_ms: int, timeout_ms: int) -> Lease:
        lease = Lease(ref, now_ms + timeout_ms, now_ms, consumer)
        self._by_key[ref.key] = lease
        self._order.added(ref.key)
        consumer.unsettled += 1
        self._add_expiry(lease)
        return lease

    def restore(self, ref: MessageRef, deadline_ms: int, leased_at_ms: int) -> Lease:
        """Recovery: a lease that was sent before the restart, with no consumer now."""
        lease = Lease(ref, deadline_ms, leased_at_ms, None)
        lease.sent = True
        self._by_key[ref.key] = lease
        self._order.added(ref.key)
        self._add_expiry(lease)
        return lease

    def sent(self, leases: Iterable[Lease]) -> list[Lease]:
        """The stream is about to send these; records them (one WAL append) and returns
        those still active (a lease can end while its message waits in the buffer)."""
        committer = self._committer
        live: list[Lease] = []
        for lease in leases:
            if not lease.active:
                continue
            lease.sent = True
            committer.put(
                keys.lease_key(lease.ref.key),
                keys.encode_lease(lease.deadline_ms, lease.leased_at_ms),
                self._queue,
            )
            consumer = lease.consumer
            if consumer is not None and consumer.stream_leases is not None:
                consumer.stream_leases[lease.ref.key] = lease
            live.append(lease)
        if live:
            committer.write_now()
        return live

    def extend(self, lease: Lease, deadline_ms: int) -> None:
        self._drop_expiry(lease)
        lease.deadline_ms = deadline_ms
        if lease.sent:
            self._committer.put(
                keys.lease_key(lease.ref.key),
                keys.encode_lease(deadline_ms, lease.leased_at_ms),
                self._queue,
            )
        self._add_expiry(lease)

    def due(self, deadline_ms: int) -> list[Lease]:
        """Takes out the leases whose deadline is `deadline_ms` (timer callback)."""
        bucket = self._expiring.pop(deadline_ms, None)
        return list(bucket.values()) if bucket else []

    def has_due(self, deadline_ms: int) -> bool:
        """Whether a timer entry for `deadline_ms` still has leases to expire."""
        return deadline_ms in self._expiring

    def _add_expiry(self, lease: Lease) -> None:
        bucket = self._expiring.get(lease.deadline_ms)
        if bucket is None:
            bucket = self._expiring[lease.deadline_ms] = {}
            self._schedule_expiry(lease.deadline_ms)
        bucket[lease.ref.key] = lease

    def _drop_expiry(self, lease: Lease) -> None:
        bucket = self._expiring.get(lease.deadline_ms)
        if bucket is not None:
            bucket.pop(lease.ref.key, None)
            if not bucket:
                del self._expiring[lease.deadline_ms]

    def end(self, lease: Lease) -> None:
        """Ends an active lease: out of the table, its record deleted, its slot returned."""
        lease.active = False
        key = lease.ref.key
        del self._by_key[key]
        self._order.removed(key)
        self._drop_expiry(lease)
        if lease.sent:
            self._committer.delete(keys.lease_key(key), self._queue)
        consumer = lease.consumer
        if consumer is None:
            return
        consumer.unsettled -= 1
        if consumer.stream_leases is not None:
            consumer.stream_leases.pop(key, None)
        if self._ring.room_freed(consumer):
            self._on_room()

    def end_all(self) -> list[Lease]:
        """Queue deleted: every lease ends (records deleted); returns them."""
        ended = list(self._by_key.values())
        for lease in ended:
            self.end(lease)
        return ended
