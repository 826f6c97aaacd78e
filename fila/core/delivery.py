"""Delivery: consumers, the pump that leases ready messages to them, throttle wake-ups.

Consumers with room sit in their queue's `ConsumerRing` and are served
round-robin; each pick is the DRR's next message whose throttle keys have
tokens. A key whose head is throttled is parked and the queue is woken when its
tokens can be there. A delivery takes the message's record (kept in memory since its
write, or read from storage: `CoreState.take_record`) and buffers it for the
consumer's stream; the stream takes what is buffered (up to its
`max_batch`), `sending` records those leases (one WAL append per frame) and
returns the frame to write, and `sent` gives its bytes back once the write returns.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import TYPE_CHECKING

from fila.core.consumers import Consumer
from fila.core.drr import FairnessKey
from fila.core.errors import BrokerError, Unavailable
from fila.core.frames import batch_frame, single_frame

if TYPE_CHECKING:
    from fila.core.queue import Queue
    from fila.core.settlement import Settlement
    from fila.core.state import CoreState

log = logging.getLogger("fila.broker")

_wake_seq = itertools.count()


class Delivery:
    """Attaching consumers, leasing messages to them, and handing frames to streams."""

    def __init__(self, state: CoreState, settlement: Settlement) -> None:
        self.state = state
        self._settlement = settlement
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
        self.state.check_open()
        queue = self.state.queue(queue_name)
        settings = self.state.settings
        capacity = min(prefetch, settings.max_prefetch) if prefetch else settings.consumer_buffer
        consumer = Consumer(
            queue.name,
            capacity=capacity,
            max_batch=max(1, min(max_batch, settings.max_prefetch)),
            max_buffered_bytes=settings.stream_buffer_bytes,
            budget=self.state.buffers,
            owns_settlement=owns_settlement,
        )
        queue.consumers.add(consumer)
        self.state.mark_dirty(queue)
        return consumer

    def detach_consumer(
        self, consumer: Consumer, reason: BrokerError | None = None, *, keep_sent: bool = False
    ) -> None:
        """The stream ended (or must end, for `reason`): it leaves its queue's ring, and
        its leases end as `Settlement.consumer_ended` decides (`keep_sent`: a broker
        shutting down, whose clients may settle what they hold after the restart)."""
        queue = self.state.queues.get(consumer.queue_name)
        consumer.close(reason or Unavailable("consumer closed"))
        unsent = consumer.release_unsent()
        if queue is not None and queue.consumers.remove(consumer):
            self._settlement.consumer_ended(queue, consumer, unsent, keep_sent=keep_sent)
        self.buffers_released()

    def end_consumers(self, reason: BrokerError) -> None:
        """Ends every consume stream with `reason` (at shutdown, and when a cluster node
        loses its lease and must stop serving). Unsent deliveries go back; sent ones
        stay leased, so their clients can still settle them with AckBatch/NackBatch
        once the broker serves again, before their visibility timeout."""
        for queue in list(self.state.queues.values()):
            for consumer in list(queue.consumers.consumers.values()):
                self.detach_consumer(consumer, reason, keep_sent=True)

    def sending(self, consumer: Consumer, limit: int) -> bytes | None:
        """The next frame for `consumer`'s stream, or None if nothing is buffered.

        Takes up to `limit` buffered deliveries, records their leases (one WAL
        append, before the bytes leave), and encodes them as one frame: in
        `messages` when the stream asked for batches, else as one `message`."""
        taken = consumer.take(limit)
        if not taken:
            return None
        queue = self.state.queues.get(consumer.queue_name)
        if queue is None:
            self.sent(consumer)
            return None
        live = queue.leases.sent(lease for lease, _ in taken)
        now = self.state.clock.now_ms()
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
        queue = self.state.queues.get(consumer.queue_name)
        if queue is not None and (
            queue.consumers.room_freed(consumer)
            or (self._buffers_blocked and consumer.waiting and not consumer.held_bytes)
        ):  # with the budget spent, a stream that sent all it had is served again
            self.state.mark_dirty(queue)
        self.buffers_released()

    def pump(self, queue: Queue) -> None:
        """Leases ready messages to consumers with room, round-robin, in DRR order."""
        ring = queue.consumers
        drr = queue.drr
        buffers = self.state.buffers
        throttles = self.state.throttles
        has_tokens = throttles.try_take if throttles.active else None
        now = self.state.clock.now_ms()
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
            record = self.state.take_record(ref.key)
            if record is None:  # cannot happen while the ready-after-commit rule holds
                log.error(
                    "ready message has no stored record", extra={"id": ref.id, "queue": queue.name}
                )
                continue
            consumer.offer(grant(ref, consumer, now, timeout), record)
            ring.served(consumer)
        if drr.newly_parked:
            self._schedule_throttle_wake(queue, drr.take_newly_parked())

    def buffers_released(self) -> None:
        """Stream buffers gave bytes back: if the pump stopped because the broker-wide
        budget was spent, every queue gets its turn again (not only the one whose
        stream freed them: a deleted queue's, say, has no turn left to take)."""
        if self._buffers_blocked and not self.state.buffers.exhausted:
            self._buffers_blocked = False
            self.state.mark_all_dirty()

    def _schedule_throttle_wake(self, queue: Queue, keys: list[FairnessKey]) -> None:
        """Schedules each newly parked key's return for when its tokens can be there.

        A heap per queue, with one timer for its earliest entry: a wake-up returns
        only the keys that are due, so thousands of throttled keys cost O(log n) each
        per wake, not a pass over all of them."""
        if not keys:
            return
        queue.counters.throttled += len(keys)
        throttles = self.state.throttles
        now = self.state.clock.now_ms()
        wakes = queue.throttle_wakes
        for key in keys:
            wait_s = throttles.seconds_until_available(key.head_throttle_keys())
            # the first millisecond at which the token is there, not the one after it
            wait_ms = max(1, math.ceil(wait_s * 1000 - 1e-6))
            heapq.heappush(wakes, (now + wait_ms, next(_wake_seq), key))
        self._arm_throttle_wake(queue)

    def _arm_throttle_wake(self, queue: Queue) -> None:
        wakes = queue.throttle_wakes
        if not wakes:
            return
        earliest = wakes[0][0]
        if queue.throttle_wake_ms is None or earliest < queue.throttle_wake_ms:
            queue.throttle_wake_ms = earliest
            self.state.timers.at(earliest, self._throttle_wake, queue)

    def _throttle_wake(self, queue: Queue) -> None:
        due = queue.throttle_wake_ms
        now = self.state.clock.now_ms()
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
            self.state.mark_dirty(queue)
        self._arm_throttle_wake(queue)
