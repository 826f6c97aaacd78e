"""Delivery: consumers, the pump that leases ready messages to them, throttle wake-ups.

Consumers with room sit in their queue's `waiting` ring and are served
round-robin; each pick is the DRR's next message whose throttle keys have
tokens. A key whose head is throttled is parked and the queue is woken when
its tokens can be there. A delivery reads the stored record back from RocksDB
and sends it with `leased_at` appended (see `frames`).
"""

from __future__ import annotations

import logging

from fila.core.consumer import Consumer
from fila.core.errors import Unavailable
from fila.core.frames import delivery_frame
from fila.core.queue import Queue
from fila.core.records import Lease, MessageRef
from fila.core.state import BrokerState
from fila.storage import keys

log = logging.getLogger("fila.broker")


class Delivery(BrokerState):
    """Attaching consumers and leasing messages to them."""

    def attach_consumer(self, queue_name: str) -> Consumer:
        self._check_open()
        queue = self._queue(queue_name)
        consumer = Consumer(queue.name, self.settings.consumer_buffer)
        queue.consumers[consumer.id] = consumer
        queue.waiting.append(consumer)
        consumer.waiting = True
        self._mark_dirty(queue)
        return consumer

    def detach_consumer(self, consumer: Consumer, reason: Unavailable | None = None) -> None:
        """The stream ended (or must end, for `reason`): messages it never sent go
        straight back; sent ones stay leased."""
        queue = self.queues.get(consumer.queue_name)
        unsent = consumer.close(reason or Unavailable("consumer closed"))
        if queue is None or queue.consumers.pop(consumer.id, None) is None:
            return
        if consumer.waiting:
            queue.waiting.remove(consumer)
            consumer.waiting = False
        for lease in unsent:
            if lease.active and not lease.sent:
                self._return_unsent(queue, lease)

    def consumer_took(self, lease: Lease) -> bool:
        """The stream is about to send `lease`; False if the lease ended while buffered.

        The lease is persisted here, not when the message was queued for the stream:
        after a crash, a message that never left the broker must be ready at once and
        not count an attempt. And it reaches the WAL before the message leaves, so a
        killed broker brings a delivered message back as leased (with its deadline,
        then attempt + 1), never as an undelivered one.
        """
        if not lease.active:
            return False
        lease.sent = True
        committer = self.committer
        committer.put(
            keys.lease_key(lease.ref.key), keys.encode_lease(lease.deadline_ms, lease.leased_at_ms)
        )
        committer.write_now()
        return True

    def _pump(self, queue: Queue) -> None:
        """Leases ready messages to consumers with room, round-robin, in DRR order."""
        waiting = queue.waiting
        drr = queue.drr
        throttles = self.throttles
        has_tokens = throttles.try_take if throttles.active else None
        while waiting and drr.ready_count:
            ref = drr.pick(has_tokens)
            if ref is None:
                break
            consumer = waiting[0]
            self._lease(queue, consumer, ref)
            if consumer.has_room:
                waiting.rotate(-1)
            else:
                waiting.popleft()
                consumer.waiting = False
        if drr.newly_parked:
            self._schedule_throttle_wake(queue, drr.take_newly_parked_heads())

    def _schedule_throttle_wake(self, queue: Queue, heads: list[MessageRef]) -> None:
        """Wakes the queue when the first newly parked key can have its tokens.

        Keys parked earlier already have a wake-up; a newly parked key can only
        need an earlier one (a faster bucket, or a rate just raised)."""
        if not heads:
            return
        wait_s = min(self.throttles.seconds_until_available(h.throttle_keys) for h in heads)
        wake_ms = self.clock.now_ms() + max(1, int(wait_s * 1000) + 1)
        if queue.throttle_wake_ms is None or wake_ms < queue.throttle_wake_ms:
            queue.throttle_wake_ms = wake_ms
            self.timers.at(wake_ms, self._throttle_wake, queue)

    def _throttle_wake(self, queue: Queue) -> None:
        due = queue.throttle_wake_ms
        if due is not None and self.clock.now_ms() < due:
            return  # a stale wake-up: an earlier one was scheduled after it and has run
        queue.throttle_wake_ms = None
        if not queue.deleted and queue.drr.unpark_all():
            self._mark_dirty(queue)

    def _lease(self, queue: Queue, consumer: Consumer, ref: MessageRef) -> None:
        record = self.db.get(ref.key)
        if record is None:  # cannot happen while the ready-after-commit rule holds
            log.error("ready message has no stored record id=%s queue=%s", ref.id, queue.name)
            return
        now = self.clock.now_ms()
        deadline = now + queue.record.visibility_timeout_ms
        lease = Lease(ref, record, deadline, now, consumer)
        queue.leases[ref.id] = lease
        self.timers.at(deadline, self._expire, (queue, lease))
        consumer.offer(lease, delivery_frame(record, now))
        self.counters.delivered += 1
