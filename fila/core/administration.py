"""Administration: queues, stats, runtime config (and the throttles it drives), redrive."""

from __future__ import annotations

import asyncio
import logging

from fila.core.errors import (
    ConfigKeyNotFound,
    InvalidArgument,
    QueueAlreadyExists,
    QueueNotFound,
)
from fila.core.queue import DLQ_SUFFIX, Queue, QueueRecord, validate_queue_name
from fila.core.runtime_config import ThrottleChange, validate_entry
from fila.core.state import BrokerState
from fila.core.stats import KeyStats, QueueStats
from fila.lua.hooks import DEFAULT_ENQUEUE, QueueHooks
from fila.lua.sandbox import ScriptError
from fila.storage import keys
from fila.v1 import messages_pb2

log = logging.getLogger("fila.broker")


DEFAULT_VISIBILITY_TIMEOUT_MS = 30_000
MAX_VISIBILITY_TIMEOUT_MS = 7 * 24 * 3600 * 1000


class Administration(BrokerState):
    """Queue lifecycle, stats, runtime config and redrive."""

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
        self._ready_after_commit(source, refs, fresh=True)
        self.counters.redriven += len(refs)
        return len(refs), self.committer.flushed()

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
