r"""The single owner of broker state.

Every queue, DRR ring, lease, delayed retry, throttle bucket and Lua state is
created, read and changed only here, on the event loop, so there are no locks
and every invariant lives in one place. The gRPC edge calls these methods
directly; a method validates everything before it changes anything (a bad
request leaves no trace), applies the change in memory, hands the matching
writes to the committer, and returns the future the caller awaits before
answering.

Message life cycle, and the one rule that keeps memory and disk in step: a
message becomes *ready* (deliverable) only after the write that produced its
current record is committed. So a consumer never sees a message the broker
could forget, and delivery can always read the record back from RocksDB.

    enqueue -> (commit) -> ready -> leased -> ack: deleted
                                          \-> nack / lease expiry -> ready | delayed | DLQ
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rocksdict import Rdict

from fila.config import Config
from fila.core.clock import Clock
from fila.core.consumer import Consumer
from fila.core.errors import (
    ConfigKeyNotFound,
    InvalidArgument,
    MessageNotFound,
    QueueAlreadyExists,
    QueueNotFound,
    Unavailable,
)
from fila.core.frames import delivery_frame, timestamp
from fila.core.ids import IdGenerator
from fila.core.queue import DLQ_SUFFIX, Queue, QueueRecord, validate_queue_name
from fila.core.records import Lease, MessageRef
from fila.core.runtime_config import RuntimeConfig, ThrottleChange, validate_entry
from fila.core.stats import BrokerCounters, KeyStats, QueueStats
from fila.core.throttle import Throttles
from fila.core.timers import Timers
from fila.lua.hooks import DEFAULT_ENQUEUE, DEFAULT_FAILURE, LuaLimits, QueueHooks
from fila.lua.sandbox import ScriptError
from fila.storage import keys
from fila.storage.store import Committer
from fila.v1 import messages_pb2

log = logging.getLogger("fila.broker")

DEFAULT_VISIBILITY_TIMEOUT_MS = 30_000
MAX_VISIBILITY_TIMEOUT_MS = 7 * 24 * 3600 * 1000
CONSUMER_KEEPALIVE_S = 15.0


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    quantum: int
    consumer_buffer: int
    max_message_bytes: int
    max_headers: int
    max_header_bytes: int
    lua: LuaLimits

    @classmethod
    def from_config(cls, config: Config) -> BrokerSettings:
        return cls(
            quantum=config.scheduler.quantum,
            consumer_buffer=config.scheduler.consumer_buffer,
            max_message_bytes=config.server.max_message_bytes,
            max_headers=config.server.max_headers,
            max_header_bytes=config.server.max_header_bytes,
            lua=LuaLimits(
                timeout_ms=config.lua.default_timeout_ms,
                memory_limit_bytes=config.lua.default_memory_limit_bytes,
                breaker_threshold=config.lua.circuit_breaker_threshold,
                breaker_cooldown_ms=config.lua.circuit_breaker_cooldown_ms,
            ),
        )


@dataclass(frozen=True, slots=True)
class EnqueueItem:
    headers: Mapping[str, str]
    payload: bytes


class Broker:
    def __init__(
        self, db: Rdict, committer: Committer, settings: BrokerSettings, clock: Clock
    ) -> None:
        self.db = db
        self.committer = committer
        self.settings = settings
        self.clock = clock
        self.queues: dict[str, Queue] = {}
        self.config = RuntimeConfig()
        self.throttles = Throttles(clock)
        self.timers = Timers(clock, _timer_subject_is_live)
        self.counters = BrokerCounters()
        self.ids = IdGenerator(clock)
        self._dirty: set[Queue] = set()
        self._pump_scheduled = False
        self._closing = False

    # ------------------------------------------------------------------ queues

    def create_queue(
        self, name: str, on_enqueue: str, on_failure: str, visibility_timeout_ms: int
    ) -> asyncio.Future[None]:
        self._check_open()
        validate_queue_name(name)
        if name.endswith(DLQ_SUFFIX):
            raise InvalidArgument(
                f'queue name "{name}" ends with "{DLQ_SUFFIX}", which is reserved for '
                "dead-letter queues (creating a queue creates its own)"
            )
        dlq_name = name + DLQ_SUFFIX
        if name in self.queues:
            raise QueueAlreadyExists(name)
        if dlq_name in self.queues:
            raise QueueAlreadyExists(dlq_name)
        timeout = visibility_timeout_ms or DEFAULT_VISIBILITY_TIMEOUT_MS
        if timeout > MAX_VISIBILITY_TIMEOUT_MS:
            raise InvalidArgument(
                f"visibility_timeout_ms {timeout} is over the limit of {MAX_VISIBILITY_TIMEOUT_MS}"
            )
        now = self.clock.now_ms()
        record = QueueRecord(name, on_enqueue, on_failure, timeout, "", now)
        hooks = self._make_hooks(record)
        dlq_record = QueueRecord(dlq_name, "", "", timeout, name, now)
        for rec, rec_hooks in ((record, hooks), (dlq_record, None)):
            self.queues[rec.name] = Queue(rec, rec_hooks, self.settings.quantum)
            self.committer.put(keys.queue_key(rec.name), rec.encode())
        log.info("queue created queue=%s", name)
        return self.committer.flushed()

    def delete_queue(self, name: str) -> asyncio.Future[None]:
        self._check_open()
        queue = self._queue(name)
        if queue.record.dlq_of:
            raise InvalidArgument(
                f'queue "{name}" is the dead-letter queue of "{queue.record.dlq_of}"; '
                "delete that queue instead"
            )
        self._drop_queue(queue)
        dlq_name = queue.dlq_name
        dlq = self.queues.get(dlq_name) if dlq_name else None
        if dlq is not None:
            self._drop_queue(dlq)
        log.info("queue deleted queue=%s", name)
        return self.committer.flushed()

    def list_queues(self) -> list[Queue]:
        return sorted(self.queues.values(), key=lambda q: q.name)

    def stats(self, name: str) -> QueueStats:
        queue = self._queue(name)
        per_key = [
            KeyStats(key.name, len(key.messages), key.deficit, key.weight)
            for key in queue.drr.keys.values()
        ]
        per_key.sort(key=lambda k: k.key)
        return QueueStats(
            depth=queue.depth,
            in_flight=len(queue.leases),
            active_fairness_keys=len(per_key),
            active_consumers=len(queue.consumers),
            quantum=self.settings.quantum,
            per_key=per_key,
            per_throttle=self.throttles.stats(),
        )

    # ----------------------------------------------------------------- enqueue

    def enqueue(
        self, queue_name: str, items: Sequence[EnqueueItem]
    ) -> tuple[list[str], asyncio.Future[None]]:
        """Stores a batch of messages; all are checked before any is written."""
        self._check_open()
        queue = self._queue(queue_name)
        for item in items:
            self._check_limits(item)
        hooks = queue.hooks
        now_ms = self.clock.now_ms()
        enqueued_at = timestamp(now_ms)
        committer = self.committer
        ids: list[str] = []
        refs: list[MessageRef] = []
        for item in items:
            decision = (
                hooks.on_enqueue(item.headers, len(item.payload))
                if hooks is not None
                else DEFAULT_ENQUEUE
            )
            raw_id, message_id = self.ids.next()
            key = keys.MESSAGE + raw_id
            message = messages_pb2.Message(
                id=message_id,
                headers=item.headers,
                payload=item.payload,
                metadata=messages_pb2.MessageMetadata(
                    fairness_key=decision.fairness_key,
                    weight=decision.weight,
                    throttle_keys=decision.throttle_keys,
                    queue_id=queue.name,
                ),
                timestamps=messages_pb2.MessageTimestamps(enqueued_at=enqueued_at),
            )
            committer.put(key, message.SerializeToString())
            ids.append(message_id)
            refs.append(
                MessageRef(
                    key,
                    message_id,
                    decision.fairness_key,
                    decision.weight,
                    decision.throttle_keys,
                    0,
                )
            )
        self._settle_after_commit(queue, refs, fresh=True)
        self.counters.enqueued += len(refs)
        return ids, committer.flushed()

    def _check_limits(self, item: EnqueueItem) -> None:
        settings = self.settings
        if len(item.payload) > settings.max_message_bytes:
            raise InvalidArgument(
                f"payload is {len(item.payload)} bytes, the limit is {settings.max_message_bytes}"
            )
        headers = item.headers
        if not headers:
            return
        if len(headers) > settings.max_headers:
            raise InvalidArgument(
                f"message has {len(headers)} headers, the limit is {settings.max_headers}"
            )
        size = sum(len(k.encode()) + len(v.encode()) for k, v in headers.items())
        if size > settings.max_header_bytes:
            raise InvalidArgument(
                f"headers total {size} bytes, the limit is {settings.max_header_bytes}"
            )

    # ----------------------------------------------------------------- consume

    def attach_consumer(self, queue_name: str) -> Consumer:
        self._check_open()
        queue = self._queue(queue_name)
        consumer = Consumer(queue.name, self.settings.consumer_buffer)
        queue.consumers[consumer.id] = consumer
        queue.waiting.append(consumer)
        consumer.waiting = True
        self._mark_dirty(queue)
        return consumer

    def detach_consumer(self, consumer: Consumer) -> None:
        """The stream ended: messages it never sent go straight back; sent ones stay leased."""
        queue = self.queues.get(consumer.queue_name)
        unsent = consumer.close(Unavailable("consumer closed"))
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
        not count an attempt. (A message sent just before its lease write reached the
        log comes back once, with attempt_count 0: at-least-once.)
        """
        if not lease.active:
            return False
        lease.sent = True
        self.committer.put(
            keys.lease_key(lease.ref.key), keys.encode_lease(lease.deadline_ms, lease.leased_at_ms)
        )
        return True

    def _end_lease(self, queue: Queue, lease: Lease) -> None:
        """Every way a lease ends comes here, so its consumer gets the slot back."""
        lease.active = False
        consumer = lease.consumer
        if consumer is None:
            return
        consumer.unsettled -= 1
        if not consumer.waiting and consumer.has_room and consumer.id in queue.consumers:
            queue.waiting.append(consumer)
            consumer.waiting = True
            self._mark_dirty(queue)

    def _mark_dirty(self, queue: Queue) -> None:
        self._dirty.add(queue)
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump_dirty)

    def _pump_dirty(self) -> None:
        self._pump_scheduled = False
        dirty, self._dirty = self._dirty, set()
        for queue in dirty:
            if not queue.deleted:
                self._pump(queue)

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

    # ------------------------------------------------------------- ack / nack

    def _settle(self, queue_name: str, message_id: str) -> tuple[Queue, Lease]:
        """Ends the lease an ack or nack names; NOT_FOUND unless it is leased in that queue."""
        self._check_open()
        queue = self._queue(queue_name)
        lease = queue.leases.pop(message_id, None)
        if lease is None:
            raise MessageNotFound(queue_name, message_id)
        self._end_lease(queue, lease)
        return queue, lease

    def ack(self, queue_name: str, message_id: str) -> asyncio.Future[None]:
        _, lease = self._settle(queue_name, message_id)
        key = lease.ref.key
        self.committer.delete(key)
        self.committer.delete(keys.lease_key(key))
        self.counters.acked += 1
        return self.committer.flushed()

    def nack(self, queue_name: str, message_id: str, error: str) -> asyncio.Future[None]:
        queue, lease = self._settle(queue_name, message_id)
        self.counters.nacked += 1
        self._fail(queue, lease, error, run_hook=True)
        return self.committer.flushed()

    def _expire(self, subject: tuple[Queue, Lease]) -> None:
        queue, lease = subject
        if not lease.active:
            return
        if not lease.sent:
            self._return_unsent(queue, lease)
            return
        self._end_lease(queue, lease)
        del queue.leases[lease.ref.id]
        self.counters.expired += 1
        self._fail(queue, lease, "visibility timeout expired", run_hook=False)

    def _fail(self, queue: Queue, lease: Lease, error: str, *, run_hook: bool) -> None:
        """A delivery failed: count the attempt, then retry now, later, or dead-letter."""
        ref = lease.ref
        ref.attempt_count += 1
        message = messages_pb2.Message.FromString(lease.record)
        message.metadata.attempt_count = ref.attempt_count
        decision = DEFAULT_FAILURE
        hooks = queue.hooks
        if run_hook and hooks is not None and hooks.has_on_failure:
            decision = hooks.on_failure(ref.id, message.headers, ref.attempt_count, error)
        committer = self.committer
        committer.delete(keys.lease_key(ref.key))
        dlq_name = queue.dlq_name
        dlq = self.queues.get(dlq_name) if dlq_name and decision.action == "dlq" else None
        if dlq is not None:
            message.metadata.queue_id = dlq.name
            committer.put(ref.key, message.SerializeToString())
            self._settle_after_commit(dlq, [ref], fresh=False)
            self.counters.dead_lettered += 1
        elif decision.delay_ms > 0:
            committer.put(ref.key, message.SerializeToString())
            due = self.clock.now_ms() + decision.delay_ms
            committer.put(keys.delay_key(ref.key), keys.encode_due(due))
            queue.delayed[ref.id] = ref
            committer.after_commit(lambda: self.timers.at(due, self._due, (queue, ref)))
        else:
            committer.put(ref.key, message.SerializeToString())
            self._settle_after_commit(queue, [ref], fresh=False)

    def _due(self, subject: tuple[Queue, MessageRef]) -> None:
        queue, ref = subject
        if queue.deleted or queue.delayed.get(ref.id) is not ref:
            return
        del queue.delayed[ref.id]
        self.committer.delete(keys.delay_key(ref.key))
        queue.drr.push(ref, fresh=False)
        self._mark_dirty(queue)

    def _return_unsent(self, queue: Queue, lease: Lease) -> None:
        """A leased message never reached its consumer: back to ready, no attempt counted."""
        self._end_lease(queue, lease)
        queue.leases.pop(lease.ref.id, None)
        queue.drr.push(lease.ref, fresh=False)
        self._mark_dirty(queue)

    def _settle_after_commit(self, queue: Queue, refs: list[MessageRef], *, fresh: bool) -> None:
        queue.in_limbo += len(refs)

        def settle() -> None:
            queue.in_limbo -= len(refs)
            if queue.deleted:
                for ref in refs:
                    self.committer.delete(ref.key)
                return
            push = queue.drr.push
            for ref in refs:
                push(ref, fresh=fresh)
            self._mark_dirty(queue)

        self.committer.after_commit(settle)

    # ------------------------------------------------------------------ redrive

    def redrive(self, dlq_name: str, count: int) -> tuple[int, asyncio.Future[None]]:
        self._check_open()
        dlq = self._queue(dlq_name)
        source_name = dlq.record.dlq_of
        if not source_name:
            raise InvalidArgument(f'queue "{dlq_name}" is not a dead-letter queue')
        source = self._queue(source_name)
        refs = dlq.drr.take(count if count > 0 else dlq.drr.ready_count)
        hooks = source.hooks
        for ref in refs:
            record = self.db.get(ref.key)
            if record is None:
                log.error("dead-lettered message has no stored record id=%s", ref.id)
                continue
            message = messages_pb2.Message.FromString(record)
            decision = (
                hooks.on_enqueue(message.headers, len(message.payload))
                if hooks is not None
                else DEFAULT_ENQUEUE
            )
            metadata = message.metadata
            metadata.fairness_key = ref.fairness_key = decision.fairness_key
            metadata.weight = ref.weight = decision.weight
            del metadata.throttle_keys[:]
            metadata.throttle_keys.extend(decision.throttle_keys)
            ref.throttle_keys = decision.throttle_keys
            metadata.attempt_count = ref.attempt_count = 0
            metadata.queue_id = source.name
            self.committer.put(ref.key, message.SerializeToString())
        self._settle_after_commit(source, refs, fresh=True)
        self.counters.redriven += len(refs)
        return len(refs), self.committer.flushed()

    # ----------------------------------------------------------- runtime config

    def set_config(self, key: str, value: str) -> asyncio.Future[None]:
        self._check_open()
        change = validate_entry(key, value)
        self.config.set(key, value)
        if value == "":
            self.committer.delete(keys.config_key(key))
        else:
            self.committer.put(keys.config_key(key), value.encode())
        if change is not None:
            self._apply_throttle(change)
        return self.committer.flushed()

    def get_config(self, key: str) -> str:
        value = self.config.get(key)
        if value is None:
            raise ConfigKeyNotFound(key)
        return value

    def list_config(self, prefix: str) -> list[tuple[str, str]]:
        return self.config.items(prefix)

    def _apply_throttle(self, change: ThrottleChange) -> None:
        if change.rate is None or change.burst is None:
            self.throttles.remove(change.key)
        else:
            self.throttles.configure(change.key, change.rate, change.burst)
        for queue in self.queues.values():
            if queue.drr.unpark_all():
                self._mark_dirty(queue)

    # -------------------------------------------------------------- internals

    def _queue(self, name: str) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            validate_queue_name(name)
            raise QueueNotFound(name)
        return queue

    def _check_open(self) -> None:
        if self._closing:
            raise Unavailable("broker is shutting down")

    def _make_hooks(self, record: QueueRecord) -> QueueHooks | None:
        if not (record.on_enqueue_script.strip() or record.on_failure_script.strip()):
            return None
        try:
            return QueueHooks(
                record.name,
                record.on_enqueue_script,
                record.on_failure_script,
                self.settings.lua,
                self.config.get,
                self.clock,
            )
        except ScriptError as exc:
            raise InvalidArgument(f'queue "{record.name}": {exc}') from None

    def _drop_queue(self, queue: Queue) -> None:
        queue.deleted = True
        del self.queues[queue.name]
        self._dirty.discard(queue)
        committer = self.committer
        for consumer in list(queue.consumers.values()):
            consumer.close(QueueNotFound(queue.name))
        queue.consumers.clear()
        queue.waiting.clear()
        for lease in queue.leases.values():
            lease.active = False
            committer.delete(lease.ref.key)
            committer.delete(keys.lease_key(lease.ref.key))
        queue.leases.clear()
        for ref in queue.delayed.values():
            committer.delete(ref.key)
            committer.delete(keys.delay_key(ref.key))
        queue.delayed.clear()
        for ref in queue.drr.drain():
            committer.delete(ref.key)
        committer.delete(keys.queue_key(queue.name))

    def add_recovered_queue(self, record: QueueRecord) -> Queue:
        """Recovery only: a stored script that no longer loads is logged, not fatal."""
        try:
            hooks = self._make_hooks(record)
        except InvalidArgument as exc:
            log.error(
                "queue %s: stored script no longer loads, hooks disabled: %s", record.name, exc
            )
            hooks = None
        queue = Queue(record, hooks, self.settings.quantum)
        self.queues[record.name] = queue
        return queue

    def recovered_config(self, key: str, value: str) -> None:
        self.config.set(key, value)
        try:
            change = validate_entry(key, value)
        except InvalidArgument as exc:
            log.error("stored config %s is invalid, ignored for throttling: %s", key, exc)
            return
        if change is not None:
            self._apply_throttle(change)

    def schedule_expiry(self, queue: Queue, lease: Lease) -> None:
        self.timers.at(lease.deadline_ms, self._expire, (queue, lease))

    def schedule_due(self, queue: Queue, ref: MessageRef, due_ms: int) -> None:
        queue.delayed[ref.id] = ref
        self.timers.at(due_ms, self._due, (queue, ref))

    def mark_all_dirty(self) -> None:
        for queue in self.queues.values():
            self._mark_dirty(queue)

    def close(self) -> None:
        """Stops accepting work, returns unsent deliveries and commits what is pending."""
        self._closing = True
        for queue in list(self.queues.values()):
            for consumer in list(queue.consumers.values()):
                self.detach_consumer(consumer)
                consumer.close(Unavailable("broker is shutting down"))
        self.committer.flush_now()
        self.timers.close()


def _timer_subject_is_live(subject: object) -> bool:
    """Whether a timer entry can still matter (see `Timers`): leases and delayed
    retries that ended are dead; throttle wake-ups are cheap and always kept."""
    if isinstance(subject, tuple):
        queue, item = subject
        if isinstance(item, Lease):
            return item.active
        return not queue.deleted and queue.delayed.get(item.id) is item
    return True
