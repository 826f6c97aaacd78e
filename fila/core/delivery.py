"""Delivery: consumers, the pump that leases ready messages to them, throttle wake-ups.

Consumers with room sit in their queue's `ConsumerRing` and are served
round-robin; each pick is the DRR's next message whose throttle keys have
tokens. A key whose head is throttled is parked and the queue is woken when its
tokens can be there. A delivery reads the stored record from storage and buffers
it for the consumer's stream; the stream takes what is buffered (up to its
`max_batch`), `sending` records those leases (one WAL append per frame) and
returns the frame to write.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fila.core.consumers import Consumer
from fila.core.errors import Unavailable
from fila.core.frames import batch_frame, single_frame
from fila.core.records import MessageRef

if TYPE_CHECKING:
    from fila.core.broker import Broker
    from fila.core.queue import Queue

log = logging.getLogger("fila.broker")


class Delivery:
    """Attaching consumers, leasing messages to them, and handing frames to streams."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        # True while the pump stopped because every stream's buffers were full.
        self._buffers_blocked = False

    def attach_consumer(
        self,
        queue_name: str,
        *,
        prefetch: int = 0,
        max_batch: int = 0,
        owns_settlement: bool = False,
    ) -> Consumer:
        """A new consumer of `queue_name`. `prefetch` 0 means `scheduler.consumer_buffer`;
        `owns_settlement` (StreamConsume) means its sent leases return when it ends."""
        self.broker.check_open()
        queue = self.broker.queue(queue_name)
        settings = self.broker.settings
        capacity = min(prefetch, settings.max_prefetch) if prefetch else settings.consumer_buffer
        consumer = Consumer(
            queue.name,
            capacity=capacity,
            max_batch=max(1, min(max_batch, settings.max_prefetch)),
            max_buffered_bytes=settings.stream_buffer_bytes,
            budget=self.broker.buffers,
            owns_settlement=owns_settlement,
        )
        queue.consumers.add(consumer)
        self.broker.mark_dirty(queue)
        return consumer

    def detach_consumer(self, consumer: Consumer, reason: Unavailable | None = None) -> None:
        """The stream ended (or must end, for `reason`): messages it never sent go
        straight back; sent ones stay leased, except on a stream that settles its own
        (StreamConsume), whose delivered messages come back as failed attempts."""
        queue = self.broker.queues.get(consumer.queue_name)
        unsent = consumer.close(reason or Unavailable("consumer closed"))
        if queue is None or not queue.consumers.remove(consumer):
            return
        for lease in unsent:
            if lease.active and not lease.sent:
                self.broker.return_unsent(queue, lease)
        if consumer.stream_leases:
            for lease in list(consumer.stream_leases.values()):
                if lease.active:
                    self.broker.return_sent(queue, lease)
        self._unblock_buffers()

    def sending(self, consumer: Consumer, limit: int) -> bytes | None:
        """The next frame for `consumer`'s stream, or None if nothing is buffered.

        Takes up to `limit` buffered deliveries, records their leases (one WAL
        append, before the bytes leave), and encodes them as one frame: in
        `messages` when the stream asked for batches, else as one `message`."""
        taken = consumer.take(limit)
        if not taken:
            return None
        queue = self.broker.queues.get(consumer.queue_name)
        if queue is None:
            return None
        live = queue.leases.sent(lease for lease, _ in taken)
        if len(live) != len(taken):
            active = {id(lease) for lease in live}
            taken = [item for item in taken if id(item[0]) in active]
        if queue.consumers.room_freed(consumer):
            self.broker.mark_dirty(queue)
        self._unblock_buffers()
        if not taken:
            return None
        if consumer.max_batch > 1:
            return batch_frame((record, lease.leased_at_ms) for lease, record in taken)
        lease, record = taken[0]
        return single_frame(record, lease.leased_at_ms)

    def pump(self, queue: Queue) -> None:
        """Leases ready messages to consumers with room, round-robin, in DRR order."""
        ring = queue.consumers
        drr = queue.drr
        buffers = self.broker.buffers
        throttles = self.broker.throttles
        has_tokens = throttles.try_take if throttles.active else None
        now = self.broker.clock.now_ms()
        timeout = queue.record.visibility_timeout_ms
        grant = queue.leases.grant
        while drr.ready_count:
            if buffers.exhausted:
                self._buffers_blocked = True
                break
            consumer = ring.next()
            if consumer is None:
                break
            ref = drr.pick(has_tokens)
            if ref is None:
                break
            record = self.broker.read_record(ref.key)
            if record is None:  # cannot happen while the ready-after-commit rule holds
                log.error("ready message has no stored record id=%s queue=%s", ref.id, queue.name)
                continue
            consumer.offer(grant(ref, consumer, now, timeout, len(record)), record)
            ring.served(consumer)
            queue.count_delivery(ref.fairness_key)
        if drr.newly_parked:
            self._schedule_throttle_wake(queue, drr.take_newly_parked_heads())

    def _unblock_buffers(self) -> None:
        if self._buffers_blocked and not self.broker.buffers.exhausted:
            self._buffers_blocked = False
            self.broker.mark_all_dirty()

    def _schedule_throttle_wake(self, queue: Queue, heads: list[MessageRef]) -> None:
        """Wakes the queue when the first newly parked key can have its tokens.

        Keys parked earlier already have a wake-up; a newly parked key can only
        need an earlier one (a faster bucket, or a rate just raised)."""
        if not heads:
            return
        queue.counters.throttled += len(heads)
        wait_s = min(self.broker.throttles.seconds_until_available(h.throttle_keys) for h in heads)
        wake_ms = self.broker.clock.now_ms() + max(1, int(wait_s * 1000) + 1)
        if queue.throttle_wake_ms is None or wake_ms < queue.throttle_wake_ms:
            queue.throttle_wake_ms = wake_ms
            self.broker.timers.at(wake_ms, self._throttle_wake, queue)

    def _throttle_wake(self, queue: Queue) -> None:
        due = queue.throttle_wake_ms
        if due is not None and self.broker.clock.now_ms() < due:
            return  # a stale wake-up: an earlier one was scheduled after it and has run
        queue.throttle_wake_ms = None
        if not queue.deleted and queue.drr.unpark_all():
            self.broker.mark_dirty(queue)
