r"""The broker: the single owner of every queue, message, lease, consumer and throttle.

Everything is created, read and changed only by this object, on the event loop,
so there are no locks and every invariant lives in one place. The gRPC edge
decodes a request, calls one method here, and encodes the answer. The work is
split by concern: this class holds the state and does enqueue and settlement
(ack, nack, extend, expiry, delays); `broker.delivery` (see `delivery.py`)
attaches consumers and runs the pump that leases messages to them, and
`broker.admin` (`administration.py`) handles queues, config, redrive, peek, purge
and stats. Both work on this object's state through its primitives and the
parts' own methods (`Drr`, `LeaseTable`, `ConsumerRing`), on the loop only.

A method validates before it changes anything (a bad request or a bad batch
item leaves no trace), applies the change in memory, hands the matching writes
to the committer, and returns the future the caller awaits before answering.

Message life cycle, and the rule that keeps memory and disk in step: a message
becomes *ready* (deliverable) only after the write that produced its current
record is committed. So a consumer never sees a message the broker could
forget, and delivery can always read the record back from storage.

    enqueue -> (commit) -> ready -> leased -> ack: deleted
          \-> delayed -/        \-> nack / expiry -> ready | delayed | DLQ
"""

from __future__ import annotations

import asyncio
import logging
import random as _random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fila.config import Config
from fila.core import stored
from fila.core.administration import Administration
from fila.core.clock import Clock
from fila.core.consumers import BufferBudget
from fila.core.delivery import Delivery
from fila.core.enqueueing import Limits, RecordEncoder, check_limits
from fila.core.errors import (
    BrokerError,
    InvalidArgument,
    MessageNotFound,
    QueueNotFound,
    ResourceExhausted,
    Unavailable,
)
from fila.core.ids import IdGenerator, parse_id
from fila.core.quarantine import Quarantine
from fila.core.queue import MAX_VISIBILITY_TIMEOUT_MS, Queue, validate_queue_name
from fila.core.records import Lease, MessageRef
from fila.core.retry import Random, policy_decision
from fila.core.runtime_config import RuntimeConfig
from fila.core.throttle import Throttles
from fila.core.timers import Timers
from fila.lua.hooks import (
    DEFAULT_ENQUEUE,
    DEFAULT_FAILURE,
    EnqueueDecision,
    FailureDecision,
    LuaLimits,
)
from fila.storage import keys
from fila.storage.backend import Storage, StorageError
from fila.storage.committer import Committer
from fila.v1 import service_pb2

log = logging.getLogger("fila.broker")

# A message's error text is kept to this many bytes (on_failure sees it; errors echo it).
MAX_ERROR_BYTES = 4096
MAX_DELAY_MS = 366 * 24 * 3600 * 1000

# What a batch item ended as: its message id, or the error the single RPC would raise.
ItemResult = str | BrokerError


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    quantum: int
    consumer_buffer: int
    max_prefetch: int
    max_batch_messages: int
    keepalive_s: float
    limits: Limits
    max_queue_depth: int
    max_queues: int
    stream_buffer_bytes: int
    total_buffer_bytes: int
    lua: LuaLimits

    @classmethod
    def from_config(cls, config: Config) -> BrokerSettings:
        server, scheduler = config.server, config.scheduler
        return cls(
            quantum=scheduler.quantum,
            consumer_buffer=scheduler.consumer_buffer,
            max_prefetch=scheduler.max_prefetch,
            max_batch_messages=server.max_batch_messages,
            keepalive_s=scheduler.keepalive_ms / 1000,
            limits=Limits(
                max_message_bytes=server.max_message_bytes,
                max_headers=server.max_headers,
                max_header_bytes=server.max_header_bytes,
                max_delay_ms=MAX_DELAY_MS,
            ),
            max_queue_depth=server.max_queue_depth,
            max_queues=server.max_queues,
            stream_buffer_bytes=scheduler.stream_buffer_bytes,
            total_buffer_bytes=scheduler.total_buffer_bytes,
            lua=LuaLimits(
                timeout_ms=config.lua.default_timeout_ms,
                memory_limit_bytes=config.lua.default_memory_limit_bytes,
                breaker_threshold=config.lua.circuit_breaker_threshold,
                breaker_cooldown_ms=config.lua.circuit_breaker_cooldown_ms,
            ),
        )


class Broker:
    def __init__(
        self,
        storage: Storage,
        committer: Committer,
        settings: BrokerSettings,
        clock: Clock,
        *,
        loop_driven_timers: bool = True,
        on_storage_failure: Callable[[StorageError], None] | None = None,
        random: Random = _random.random,
    ) -> None:
        """`random`: the draw for retry backoff jitter (tests pin it)."""
        self.storage = storage
        self.random = random
        self.committer = committer
        self.settings = settings
        self.clock = clock
        self.queues: dict[str, Queue] = {}
        self.config = RuntimeConfig()
        self.throttles = Throttles(clock)
        self.timers = Timers(clock, _timer_subject_is_live, loop_driven=loop_driven_timers)
        self.ids = IdGenerator(clock)
        self.buffers = BufferBudget(settings.total_buffer_bytes)
        self.quarantine = Quarantine()
        self._encoder = RecordEncoder()
        self._throttle_tuples: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._dirty: set[Queue] = set()
        self._pump_scheduled = False
        self._closing = False
        self._on_storage_failure = on_storage_failure
        self.delivery = Delivery(self)
        self.admin = Administration(self)

    # -- shared primitives ---------------------------------------------------------

    def queue(self, name: str) -> Queue:
        """The live queue `name`; NOT_FOUND (or INVALID_ARGUMENT for a bad name) otherwise."""
        queue = self.queues.get(name)
        if queue is None:
            validate_queue_name(name)
            raise QueueNotFound(name)
        return queue

    def check_open(self) -> None:
        if self._closing:
            raise Unavailable("broker is shutting down")

    def mark_dirty(self, queue: Queue) -> None:
        """Schedules a pump of `queue` at the end of this turn of the event loop."""
        self._dirty.add(queue)
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump_dirty)

    def unmark_dirty(self, queue: Queue) -> None:
        self._dirty.discard(queue)

    def mark_all_dirty(self) -> None:
        for queue in self.queues.values():
            self.mark_dirty(queue)

    def _pump_dirty(self) -> None:
        self._pump_scheduled = False
        dirty, self._dirty = self._dirty, set()
        for queue in dirty:
            if not queue.deleted:
                self.delivery.pump(queue)

    def schedule_expiry(self, queue: Queue, deadline_ms: int) -> None:
        """Arms the timer for `queue`'s leases due at `deadline_ms` (one per millisecond)."""
        self.timers.at(deadline_ms, self._expire, (queue, deadline_ms))

    def ready_after_commit(self, queue: Queue, refs: Sequence[MessageRef], *, fresh: bool) -> None:
        """Makes `refs` deliverable once the write that produced their records is
        committed: the rule that keeps a consumer from seeing a message the broker
        could still lose. Until then they count in the queue's depth (`limbo`)."""
        limbo = queue.limbo
        for ref in refs:
            limbo[ref.key] = ref

        def settle() -> None:
            if queue.deleted:
                return
            push = queue.drr.push
            pushed = False
            for ref in refs:
                if limbo.pop(ref.key, None) is not None:  # else purged meanwhile
                    push(ref, fresh=fresh)
                    pushed = True
            if pushed:
                self.mark_dirty(queue)

        self.committer.after_commit(settle)

    def delay(self, queue: Queue, ref: MessageRef, due_ms: int) -> None:
        """Stores `ref` as delayed until `due_ms`; it becomes ready then (durably)."""
        queue.delayed[ref.key] = ref
        self.committer.put(keys.delay_key(ref.key), keys.encode_due(due_ms))
        self.committer.after_commit(
            lambda: self.timers.at(due_ms, self.release_delayed, (queue, ref))
        )

    def release_delayed(self, subject: tuple[Queue, MessageRef]) -> None:
        """Timer callback: a delayed message is due and becomes ready."""
        queue, ref = subject
        if queue.deleted or queue.delayed.get(ref.key) is not ref:
            return  # purged, deleted or already moved
        del queue.delayed[ref.key]
        self.committer.delete(keys.delay_key(ref.key))
        queue.drr.push(ref, fresh=False)
        self.mark_dirty(queue)

    def read_record(self, key: bytes) -> bytes | None:
        """A stored record; a read that fails its checksum stops the broker."""
        try:
            return self.storage.get(key)
        except StorageError as exc:
            self._storage_failed(exc)
            raise Unavailable(f"{exc}; the broker is stopping") from None

    def _storage_failed(self, exc: StorageError) -> None:
        log.critical("storage failure, stopping", extra={"error": str(exc)})
        if self._on_storage_failure is not None:
            self._on_storage_failure(exc)

    def decide_enqueue(self, queue: Queue, headers: object, payload_size: int) -> EnqueueDecision:
        """`on_enqueue`'s decision for a message (enqueue and redrive), keys shared."""
        hooks = queue.hooks
        if hooks is None or not hooks.has_on_enqueue:
            return DEFAULT_ENQUEUE
        decision = hooks.on_enqueue(headers, payload_size)  # type: ignore[arg-type]
        throttle_keys = decision.throttle_keys
        if throttle_keys:
            shared = self._throttle_tuples.get(throttle_keys)
            if shared is None:
                if len(self._throttle_tuples) > 100_000:
                    self._throttle_tuples.clear()
                shared = self._throttle_tuples[throttle_keys] = throttle_keys
            if shared is not throttle_keys:
                decision = EnqueueDecision(decision.fairness_key, decision.weight, shared)
        return decision

    # -- enqueue -------------------------------------------------------------------

    def enqueue(
        self, requests: Sequence[service_pb2.EnqueueRequest]
    ) -> tuple[list[ItemResult], asyncio.Future[None]]:
        """Stores a batch; each item is checked and hooked on its own.

        An item that fails gets its error in the results and stores nothing; the
        others are stored. The future resolves when every stored item is committed.
        Note: the requests are consumed (their records are built from them).
        """
        self.check_open()
        limits = self.settings.limits
        max_depth = self.settings.max_queue_depth
        now_ms = self.clock.now_ms()
        committer = self.committer
        encode = self._encoder.encode
        next_id = self.ids.next
        results: list[ItemResult] = []
        ready: dict[Queue, list[MessageRef]] = {}
        for request in requests:
            try:
                queue = self.queue(request.queue)
                check_limits(request, limits)
                if max_depth:
                    depth = queue.depth + len(ready.get(queue, ()))
                    if depth >= max_depth:
                        raise ResourceExhausted(
                            f'queue "{queue.name}" is full: {depth} messages, '
                            f"the limit is {max_depth}"
                        )
                decision = self.decide_enqueue(queue, request.headers, len(request.payload))
            except BrokerError as exc:
                # Without its traceback: that holds this frame, and with it every
                # request and result of the batch, until the cycle collector runs.
                results.append(exc.with_traceback(None))
                continue
            delay_ms = request.delay_ms
            raw_id, message_id = next_id()
            key = keys.MESSAGE + raw_id
            committer.put(key, encode(request, message_id, decision, queue.name, now_ms))
            ref = MessageRef(key, decision.fairness_key, decision.weight, decision.throttle_keys, 0)
            if delay_ms:
                self.delay(queue, ref, now_ms + delay_ms)
            else:
                ready.setdefault(queue, []).append(ref)
            queue.counters.enqueued += 1
            results.append(message_id)
        for queue, refs in ready.items():
            self.ready_after_commit(queue, refs, fresh=True)
        return results, committer.flushed()

    # -- settlement: ack, nack, extend, expiry --------------------------------------

    def _named_lease(self, queue: Queue, message_id: str) -> Lease:
        raw = parse_id(message_id)
        lease = None if raw is None else queue.leases.get(keys.MESSAGE + raw)
        if lease is None:
            raise MessageNotFound(queue.name, message_id)
        return lease

    def ack(
        self, items: Sequence[tuple[str, str]]
    ) -> tuple[list[BrokerError | None], asyncio.Future[None]]:
        """Acks (queue, message id) pairs, each on its own; durable when the future resolves."""
        self.check_open()
        results: list[BrokerError | None] = []
        for queue_name, message_id in items:
            try:
                queue = self.queue(queue_name)
                lease = self._named_lease(queue, message_id)
            except BrokerError as exc:
                results.append(exc)
                continue
            self._ack(queue, lease)
            results.append(None)
        return results, self.committer.flushed()

    def nack(
        self, items: Sequence[tuple[str, str, str]]
    ) -> tuple[list[BrokerError | None], asyncio.Future[None]]:
        """Nacks (queue, message id, error) triples, each on its own (see `_fail`)."""
        self.check_open()
        results: list[BrokerError | None] = []
        for queue_name, message_id, error in items:
            try:
                queue = self.queue(queue_name)
                lease = self._named_lease(queue, message_id)
                self._fail(queue, lease, error, run_hook=True)
            except BrokerError as exc:
                results.append(exc)
                continue
            queue.counters.nacked += 1
            results.append(None)
        return results, self.committer.flushed()

    def extend_lease(
        self, queue_name: str, message_id: str, extend_ms: int
    ) -> tuple[int, asyncio.Future[None]]:
        """Pushes a lease's deadline to now + `extend_ms` (0: the visibility timeout)."""
        self.check_open()
        queue = self.queue(queue_name)
        if extend_ms > MAX_VISIBILITY_TIMEOUT_MS:
            raise InvalidArgument(
                f"extend_ms {extend_ms} is over the limit of {MAX_VISIBILITY_TIMEOUT_MS}"
            )
        lease = self._named_lease(queue, message_id)
        deadline = self.clock.now_ms() + (extend_ms or queue.record.visibility_timeout_ms)
        queue.leases.extend(lease, deadline)
        return deadline, self.committer.flushed()

    def settle_on_stream(
        self,
        consumer_id: int,
        queue_name: str,
        acks: Sequence[str],
        nacks: Sequence[tuple[str, str]],
    ) -> None:
        """StreamConsume settlements, in order, durable with the next group commit.

        Raises MessageNotFound for an id not leased on this stream (the stream then
        ends, and `detach_consumer` returns its leases)."""
        queue = self.queue(queue_name)
        consumer = queue.consumers.consumers.get(consumer_id)
        leases = consumer.stream_leases if consumer is not None else None
        if leases is None:
            raise Unavailable("consumer closed")
        for message_id in acks:
            raw = parse_id(message_id)
            lease = None if raw is None else leases.get(keys.MESSAGE + raw)
            if lease is None:
                raise MessageNotFound(queue.name, message_id)
            self._ack(queue, lease)
        for message_id, error in nacks:
            raw = parse_id(message_id)
            lease = None if raw is None else leases.get(keys.MESSAGE + raw)
            if lease is None:
                raise MessageNotFound(queue.name, message_id)
            self._fail(queue, lease, error, run_hook=True)
            queue.counters.nacked += 1
        self.committer.flushed()  # no one awaits it; it makes sure a sync follows

    def _ack(self, queue: Queue, lease: Lease) -> None:
        queue.leases.end(lease)
        self.committer.delete(lease.ref.key)
        queue.counters.acked += 1

    def _expire(self, subject: tuple[Queue, int]) -> None:
        """Timer callback: the leases of `queue` due at a deadline ran out."""
        queue, deadline_ms = subject
        if queue.deleted:
            return
        for lease in queue.leases.due(deadline_ms):
            if not lease.active:
                continue
            if not lease.sent:
                self.return_unsent(queue, lease)
                continue
            try:
                self._fail(queue, lease, "visibility timeout expired", run_hook=False)
            except Exception:  # one lease's failure must not strand the rest of its bucket
                log.exception(
                    "a lease could not expire",
                    extra={"queue": queue.name, "message_id": lease.ref.id},
                )
                continue
            queue.counters.expired += 1

    def return_unsent(self, queue: Queue, lease: Lease) -> None:
        """A leased message never reached its consumer: back to ready, no attempt counted."""
        queue.leases.end(lease)
        queue.drr.push(lease.ref, fresh=False)
        self.mark_dirty(queue)

    def return_sent(self, queue: Queue, lease: Lease) -> None:
        """A StreamConsume stream ended holding a delivered message: it failed an attempt
        (like an expiry, without running on_failure) and is ready again at once."""
        queue.counters.expired += 1
        self._fail(queue, lease, "consumer stream ended", run_hook=False, wait=False)

    def _fail(
        self, queue: Queue, lease: Lease, error: str, *, run_hook: bool, wait: bool = True
    ) -> None:
        """A delivery failed: count the attempt, then retry now, later, or dead-letter.

        Who decides: a queue with an `on_failure` hook decides as it always did (the
        hook on a nack, `run_hook`, with its own fallbacks; at once otherwise); a queue
        without one goes by its retry policy (`fila.core.retry`; at once, but still
        dead-lettered when its attempts are used up, when not `wait`). The message
        keeps why and when it failed (`last_error`, `last_failed_at`,
        `dead_lettered_at`).

        Everything that can fail (reading the record, the hook) happens before
        anything changes, so a failure here leaves the lease as it was. A record that
        is missing, or reads back but does not decode, cannot be retried or
        dead-lettered: the lease ends, and the record is set aside
        (`fila.core.quarantine`)."""
        ref = lease.ref
        record = self.read_record(ref.key)
        if record is None:  # lost: nothing to retry or dead-letter
            queue.leases.end(lease)
            log.error(
                "a leased message has no stored record; its lease ended",
                extra={"queue": queue.name, "message_id": ref.id},
            )
            return
        try:
            message = stored.decode_message(ref.key, record)
        except stored.BadRecord as exc:
            queue.leases.end(lease)
            self.quarantine.set_aside(self.committer, ref.key, record, str(exc))
            return
        attempts = ref.attempt_count + 1
        error = _truncate(error, MAX_ERROR_BYTES)
        hooks = queue.hooks
        if hooks is None or not hooks.has_on_failure:
            decision = self._policy(queue, attempts, wait)
        elif run_hook:
            decision = hooks.on_failure(ref.id, message.headers, attempts, error)
        else:
            decision = DEFAULT_FAILURE
        dlq_name = queue.dlq_name
        dlq = self.queues.get(dlq_name) if dlq_name and decision.action == "dlq" else None

        queue.leases.end(lease)
        now_ms = self.clock.now_ms()
        ref.attempt_count = attempts
        metadata = message.metadata
        metadata.attempt_count = attempts
        metadata.last_error = error
        metadata.last_failed_at.FromMilliseconds(now_ms)
        if dlq is not None:
            metadata.queue_id = dlq.name
            metadata.dead_lettered_at.FromMilliseconds(now_ms)
        self.committer.put(ref.key, stored.rebuild_message(message))
        if dlq is not None:
            queue.counters.dead_lettered += 1
            self.ready_after_commit(dlq, [ref], fresh=False)
        elif decision.delay_ms > 0:
            self.delay(queue, ref, now_ms + decision.delay_ms)
        else:
            self.ready_after_commit(queue, [ref], fresh=False)

    def _policy(self, queue: Queue, attempts: int, wait: bool) -> FailureDecision:
        record = queue.record
        return policy_decision(
            record.max_attempts, record.retry_backoff, attempts, self.random, wait=wait
        )

    # -- lifecycle -----------------------------------------------------------------

    def close(self) -> None:
        """Stops accepting work, returns unsent deliveries and commits what is pending."""
        self._closing = True
        self.end_consumers(Unavailable("broker is shutting down"))
        self.committer.flush_now()
        self.timers.close()

    def end_consumers(self, reason: BrokerError) -> None:
        """Ends every consume stream with `reason` (at shutdown, and when a cluster node
        loses its lease and must stop serving). Unsent deliveries go back; sent ones
        stay leased, so their clients can still settle them with AckBatch/NackBatch
        once the broker serves again, before their visibility timeout."""
        for queue in list(self.queues.values()):
            for consumer in list(queue.consumers.consumers.values()):
                self.delivery.detach_consumer(consumer, reason, keep_sent=True)


def _truncate(text: str, limit: int) -> str:
    raw = text.encode()
    if len(raw) <= limit:
        return text
    kept = raw[: limit - 40].decode(errors="ignore")
    return f"{kept}... [truncated, {len(raw)} bytes in all]"


def _timer_subject_is_live(subject: object) -> bool:
    """Whether a timer entry can still matter (see `Timers`): an expiry whose leases
    all ended and a delayed message that moved are dead; throttle wake-ups are cheap
    and kept."""
    if isinstance(subject, tuple):
        queue, item = subject
        if queue.deleted:
            return False
        if isinstance(item, int):
            return bool(queue.leases.has_due(item))
        return bool(queue.delayed.get(item.key) is item)
    return True
