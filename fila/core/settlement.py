"""Settlement: how a lease ends. Ack deletes; nack, and lease expiry, count a failed
attempt and then retry at once, retry later (a durable delay), or dead-letter,
as the queue's `on_failure` hook decides.
"""

from __future__ import annotations

import asyncio

from fila.core.errors import MessageNotFound
from fila.core.queue import Queue
from fila.core.records import Lease, MessageRef
from fila.core.state import BrokerState
from fila.lua.hooks import DEFAULT_FAILURE
from fila.storage import keys
from fila.v1 import messages_pb2


class Settlement(BrokerState):
    """Ack, nack, lease expiry and delayed retries."""

    def _end_named_lease(self, queue_name: str, message_id: str) -> tuple[Queue, Lease]:
        """Ends the lease an ack or nack names; NOT_FOUND unless it is leased in that queue."""
        self._check_open()
        queue = self._queue(queue_name)
        lease = queue.leases.pop(message_id, None)
        if lease is None:
            raise MessageNotFound(queue_name, message_id)
        self._end_lease(queue, lease)
        return queue, lease

    def ack(self, queue_name: str, message_id: str) -> asyncio.Future[None]:
        _, lease = self._end_named_lease(queue_name, message_id)
        key = lease.ref.key
        self.committer.delete(key)
        self.committer.delete(keys.lease_key(key))
        self.counters.acked += 1
        return self.committer.flushed()

    def nack(self, queue_name: str, message_id: str, error: str) -> asyncio.Future[None]:
        queue, lease = self._end_named_lease(queue_name, message_id)
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
        if dlq is not None:
            self._ready_after_commit(dlq, [ref], fresh=False)
            self.counters.dead_lettered += 1
        elif decision.delay_ms > 0:
            due = self.clock.now_ms() + decision.delay_ms
            committer.put(keys.delay_key(ref.key), keys.encode_due(due))
            queue.delayed[ref.id] = ref
            committer.after_commit(lambda: self.timers.at(due, self._due, (queue, ref)))
        else:
            self._ready_after_commit(queue, [ref], fresh=False)

    def _due(self, subject: tuple[Queue, MessageRef]) -> None:
        queue, ref = subject
        if queue.deleted or queue.delayed.get(ref.id) is not ref:
            return
        del queue.delayed[ref.id]
        self.committer.delete(keys.delay_key(ref.key))
        queue.drr.push(ref, fresh=False)
        self._mark_dirty(queue)
