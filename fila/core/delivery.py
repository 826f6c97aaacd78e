"""Delivery: consumers, the pump that leases ready messages to them, throttle wake-ups.

Consumers with room sit in their queue's `ConsumerRing` and are served
round-robin; each pick is the DRR's next message whose throttle keys have
tokens. A key whose head is throttled is parked and the queue is woken when its
tokens can be there. A delivery reads the stored record from storage and buffers
it for the consumer's stream; the stream takes what is buffered (up to its
`max_batch`), `sending` records those leases (one WAL append per frame) and
returns the frame to write, and `sent` gives its bytes back once the write returns.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from typing import TYPE_CHECKING

from fila.core.consumers import Consumer
from fila.core.drr import FairnessKey
from fila.core.errors import BrokerError, Unavailable
from fila.core.frames import batch_frame, single_frame

if TYPE_CHECKING:
    from fila.core.broker import Broker
    from fila.core.queue import Queue

log = logging.getLogger("fila.broker")

_wake_seq = itertools.count()


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

    def detach_consumer(
        self, consumer: Consumer, reason: BrokerError | None = None, *, keep_sent: bool = False
    ) -> None:
        """The stream ended (or must end, for `reason`): messages it never sent go
        straight back; sent ones stay leased, except on a stream that settles its own
        (StreamConsume), whose delivered messages come back as failed attempts, unless
        `keep_sent` (a broker shutting down: its client may still settle them with
        AckBatch/NackBatch after the restart, before their visibility timeout)."""
        queue = self.broker.queues.get(consumer.queue_name)
        consumer.close(reason or Unavailable("consumer closed"))
        unsent = consumer.release_unsent()
        if queue is None or not queue.consumers.remove(consumer):
            self.buffers_released()
            return
        for lease in unsent:
            if lease.active and not lease.sent:
                self.broker.return_unsent(queue, lease)
        if consumer.stream_leases and not keep_sent:
            for lease in list(consumer.stream_leases.values()):
                if lease.active:
                    self.broker.return_sent(queue, lease)
        self.buffers_released()

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
            self.sent(consumer)
            return None
        live = queue.leases.sent(lease for lease, _ in taken)
        now = self.broker.clock.now_ms()
        for lease in live:  # a delivery is a lease sent, not one buffered (GetStats)
            queue.count_delivery(lease.ref, now)
        if len(live) != len(taken):
            active = {id(lease) for lease in live}
            taken = [item for item in taken if id(item[0]) in active]
        if not taken:
            self.sent(consumer)
            return None
        if consumer.max_batch > 1:
            return batch_frame((record, lease.leased_at_ms) for lease, record in taken)
        lease, record = taken[0]
        return single_frame(record, lease.leased_at_ms)

    def sent(self, consumer: Consumer) -> None:
        """The frame `sending` returned for `consumer` was written by gRPC (or will
        never be: the call ended): its bytes are given back, and the stream may be
        given more."""
        consumer.sent()
        queue = self.broker.queues.get(consumer.queue_name)
        if queue is not None and (
            queue.consumers.room_freed(consumer)
            or (self._buffers_blocked and consumer.waiting and not consumer.held_bytes)
        ):  # with the budget spent, a stream that sent all it had is served again
            self.broker.mark_dirty(queue)
        self.buffers_released()

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
                # Spent, most likely by streams that do not read (a stalled or hostile
                # client): those keep what they hold, and a stream that sends what it
                # gets is still given one message at a time. Stopping every queue
                # instead let one client with 32 unread streams stall all deliveries.
                consumer = ring.next_unbuffered()
                if consumer is None:
                    self._buffers_blocked = True
                    break
            else:
                consumer = ring.next()
                if consumer is None:
                    break
            ref = drr.pick(has_tokens)
            if ref is None:
                break
            record = self.broker.read_record(ref.key)
            if record is None:  # cannot happen while the ready-after-commit rule holds
                log.error(
                    "ready message has no stored record", extra={"id": ref.id, "queue": queue.name}
                )
                continue
            consumer.offer(grant(ref, consumer, now, timeout, len(record)), record)
            ring.served(consumer)
        if drr.newly_parked:
            self._schedule_throttle_wake(queue, drr.take_newly_parked())

    def buffers_released(self) -> None:
        """Stream buffers gave bytes back: if the pump stopped because the broker-wide
        budget was spent, every queue gets its turn again (not only the one whose
        stream freed them: a deleted queue's, say, has no turn left to take)."""
        if self._buffers_blocked and not self.broker.buffers.exhausted:
            self._buffers_blocked = False
            self.broker.mark_all_dirty()

    def _schedule_throttle_wake(self, queue: Queue, keys: list[FairnessKey]) -> None:
        """Schedules each newly parked key's return for when its tokens can be there.

        A heap per queue, with one timer for its earliest entry: a wake-up returns
        only the keys that are due, so thousands of throttled keys cost O(log n) each
        per wake, not a pass over all of them."""
        if not keys:
            return
        queue.counters.throttled += len(keys)
        throttles = self.broker.throttles
        now = self.broker.clock.now_ms()
        wakes = queue.throttle_wakes
        for key in keys:
            wait_s = throttles.seconds_until_available(key.head_throttle_keys())
            heapq.heappush(wakes, (now + max(1, int(wait_s * 1000) + 1), next(_wake_seq), key))
        self._arm_throttle_wake(queue)

    def _arm_throttle_wake(self, queue: Queue) -> None:
        wakes = queue.throttle_wakes
        if not wakes:
            return
        earliest = wakes[0][0]
        if queue.throttle_wake_ms is None or earliest < queue.throttle_wake_ms:
            queue.throttle_wake_ms = earliest
            self.broker.timers.at(earliest, self._throttle_wake, queue)

    def _throttle_wake(self, queue: Queue) -> None:
        due = queue.throttle_wake_ms
        now = self.broker.clock.now_ms()
        if due is None or now < due:
            return  # a stale wake-up: an earlier one was scheduled after it and has run
        queue.throttle_wake_ms = None
        if queue.deleted:
            return
        wakes = queue.throttle_wakes
        ready: list[FairnessKey] = []
        while wakes and wakes[0][0] <= now:
            ready.append(heapq.heappop(wakes)[2])
        if queue.drr.unpark(ready):
            self.broker.mark_dirty(queue)
        self._arm_throttle_wake(queue)
