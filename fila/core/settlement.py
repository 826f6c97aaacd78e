"""Settlement: the one module that decides how a lease ends.

A lease ends in one of these ways, each decided here and nowhere else:

- **ack** (unary, batch, or on its StreamConsume stream): the message is deleted;
- **nack**: a failed attempt; the queue's `on_failure` hook, or else its retry policy
  (`fila.core.retry`), decides between retrying now, later (a delay), or the DLQ;
- **expiry** (the visibility timeout ran out, also while the broker was down: recovery
  restores every stored lease with its deadline and the timers expire the past ones
  here): a failed attempt, decided as a nack but without running `on_failure`;
- **return unsent**: the message never left the broker (its stream ended or the
  broker is stopping before it was written): ready again, no attempt counted;
- **return sent**: a StreamConsume stream ended holding a delivered message: a failed
  attempt without `on_failure`, ready again at once (or dead-lettered once its
  attempts are used up);
- **queue deleted**: the lease and its message go with the queue.

`LeaseTable` (`fila.core.leases`) keeps the record (the table entry, the consumer's
count, the stored `l` record); this module says when and what follows. A record that
is missing or does not decode when a failed attempt needs it is set aside
(`fila.core.quarantine`), never fatal.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence

from fila.core import stored
from fila.core.consumers import Consumer
from fila.core.errors import BrokerError, InvalidArgument, MessageNotFound, Unavailable
from fila.core.ids import parse_id
from fila.core.queue import MAX_VISIBILITY_TIMEOUT_MS, Queue
from fila.core.records import Lease
from fila.core.retry import policy_decision
from fila.core.state import CoreState
from fila.lua.hooks import DEFAULT_FAILURE, FailureDecision
from fila.storage import keys

log = logging.getLogger("fila.broker")

# A message's error text is kept to this many bytes (on_failure sees it; errors echo it).
MAX_ERROR_BYTES = 4096
# A lease whose expiry failed (its record could not be read) is tried again this much later.
EXPIRY_RETRY_MS = 1000


class Settlement:
    def __init__(self, state: CoreState) -> None:
        self.state = state

    # -- by the client ------------------------------------------------------------------

    def ack(
        self, items: Sequence[tuple[str, str]]
    ) -> tuple[list[BrokerError | None], asyncio.Future[None]]:
        """Acks (queue, message id) pairs, each on its own; durable when the future resolves."""
        state = self.state
        state.check_open()
        results: list[BrokerError | None] = []
        for queue_name, message_id in items:
            try:
                queue = state.queue(queue_name)
                lease = _named(queue, queue.leases.get, message_id)
            except BrokerError as exc:
                results.append(exc)
                continue
            self._ack(queue, lease)
            results.append(None)
        return results, state.committer.flushed()

    def nack(
        self, items: Sequence[tuple[str, str, str]]
    ) -> tuple[list[BrokerError | None], asyncio.Future[None]]:
        """Nacks (queue, message id, error) triples, each on its own (see `_fail`)."""
        state = self.state
        state.check_open()
        results: list[BrokerError | None] = []
        for queue_name, message_id, error in items:
            try:
                queue = state.queue(queue_name)
                lease = _named(queue, queue.leases.get, message_id)
                self._fail(queue, lease, error, run_hook=True)
            except BrokerError as exc:
                results.append(exc)
                continue
            queue.counters.nacked += 1
            results.append(None)
        return results, state.committer.flushed()

    def extend_lease(
        self, queue_name: str, message_id: str, extend_ms: int
    ) -> tuple[int, asyncio.Future[None]]:
        """Pushes a lease's deadline to now + `extend_ms` (0: the visibility timeout);
        earlier than it was is allowed (a consumer giving a message back sooner)."""
        state = self.state
        state.check_open()
        queue = state.queue(queue_name)
        if extend_ms > MAX_VISIBILITY_TIMEOUT_MS:
            raise InvalidArgument(
                f"extend_ms {extend_ms} is over the limit of {MAX_VISIBILITY_TIMEOUT_MS}"
            )
        lease = _named(queue, queue.leases.get, message_id)
        deadline = state.clock.now_ms() + (extend_ms or queue.record.visibility_timeout_ms)
        queue.leases.extend(lease, deadline)
        return deadline, state.committer.flushed()

    def settle_on_stream(
        self,
        consumer_id: int,
        queue_name: str,
        acks: Sequence[str],
        nacks: Sequence[tuple[str, str]],
    ) -> None:
        """StreamConsume settlements, in order, durable with the next group commit.

        Raises MessageNotFound for an id not leased on this stream (the stream then
        ends, and its leases come back: `consumer_ended`)."""
        queue = self.state.queue(queue_name)
        consumer = queue.consumers.consumers.get(consumer_id)
        leases = consumer.stream_leases if consumer is not None else None
        if leases is None:
            raise Unavailable("consumer closed")
        for message_id in acks:
            self._ack(queue, _named(queue, leases.get, message_id))
        for message_id, error in nacks:
            self._fail(queue, _named(queue, leases.get, message_id), error, run_hook=True)
            queue.counters.nacked += 1
        self.state.committer.sync_soon()  # no one awaits it: it rides the next sync

    # -- by the broker ------------------------------------------------------------------

    def schedule_expiry(self, queue: Queue, deadline_ms: int) -> None:
        """Arms the timer for `queue`'s leases due at `deadline_ms` (one per millisecond)."""
        self.state.timers.at(deadline_ms, self._expire, (queue, deadline_ms))

    def consumer_ended(
        self, queue: Queue, consumer: Consumer, unsent: Iterable[Lease], *, keep_sent: bool
    ) -> None:
        """A consume stream ended: what it never sent goes straight back; what it sent
        stays leased, except on a stream that settles its own (StreamConsume), whose
        delivered messages come back as failed attempts, unless `keep_sent` (a broker
        shutting down: the client may still settle them after the restart)."""
        for lease in unsent:
            if lease.active and not lease.sent:
                self._return_unsent(queue, lease)
        if consumer.stream_leases and not keep_sent:
            for lease in list(consumer.stream_leases.values()):
                if lease.active:
                    queue.counters.expired += 1
                    self._fail(queue, lease, "consumer stream ended", run_hook=False, wait=False)

    def queue_deleted(self, queue: Queue) -> None:
        """Every lease of a deleted queue ends with its message."""
        committer = self.state.committer
        for lease in queue.leases.end_all():
            committer.delete(lease.ref.key, queue.name)

    # -- the endings ---------------------------------------------------------------------

    def _ack(self, queue: Queue, lease: Lease) -> None:
        queue.leases.end(lease)
        self.state.committer.delete(lease.ref.key, queue.name)
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
                self._return_unsent(queue, lease)
                continue
            try:
                self._fail(queue, lease, "visibility timeout expired", run_hook=False)
            except Exception:  # one lease's failure must not strand the rest of its bucket
                log.exception(
                    "a lease could not expire; it is tried again later",
                    extra={"queue": queue.name, "message_id": lease.ref.id},
                )
                # Its timer entry is spent: without a new deadline it would stay leased
                # for as long as its consumer stays connected without settling it.
                retry_at = self.state.clock.now_ms() + EXPIRY_RETRY_MS
                queue.leases.extend(lease, retry_at)
                continue
            queue.counters.expired += 1

    def _return_unsent(self, queue: Queue, lease: Lease) -> None:
        """A leased message never reached its consumer: back to ready, no attempt counted."""
        queue.leases.end(lease)
        queue.drr.push(lease.ref, fresh=False)
        self.state.mark_dirty(queue)

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
        state = self.state
        ref = lease.ref
        record = state.read_record(ref.key)
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
            state.quarantine.set_aside(state.committer, ref.key, record, str(exc))
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
        dlq = state.queues.get(dlq_name) if dlq_name and decision.action == "dlq" else None

        queue.leases.end(lease)
        now_ms = state.clock.now_ms()
        ref.attempt_count = attempts
        metadata = message.metadata
        metadata.attempt_count = attempts
        metadata.last_error = error
        metadata.last_failed_at.FromMilliseconds(now_ms)
        if dlq is not None:
            metadata.queue_id = dlq.name
            metadata.dead_lettered_at.FromMilliseconds(now_ms)
        state.committer.put(ref.key, stored.rebuild_message(message), queue.name)
        if dlq is not None:
            queue.counters.dead_lettered += 1
            state.ready_after_commit(dlq, [ref], fresh=False)
        elif decision.delay_ms > 0:
            state.delay(queue, ref, now_ms + decision.delay_ms)
        else:
            state.ready_after_commit(queue, [ref], fresh=False)

    def _policy(self, queue: Queue, attempts: int, wait: bool) -> FailureDecision:
        record = queue.record
        return policy_decision(
            record.max_attempts, record.retry_backoff, attempts, self.state.random, wait=wait
        )


def _named(queue: Queue, get: Callable[[bytes], Lease | None], message_id: str) -> Lease:
    """The lease `get` (a lookup by message key) holds for `message_id`, or NOT_FOUND."""
    raw = parse_id(message_id)
    lease = None if raw is None else get(keys.MESSAGE + raw)
    if lease is None:
        raise MessageNotFound(queue.name, message_id)
    return lease


def _truncate(text: str, limit: int) -> str:
    raw = text.encode()
    if len(raw) <= limit:
        return text
    kept = raw[: limit - 40].decode(errors="ignore")
    return f"{kept}... [truncated, {len(raw)} bytes in all]"
