"""Rebuilds the broker's in-memory state from RocksDB at startup.

Runs before the server accepts connections. Queues and runtime config come
back first (throttle buckets start full), then every stored message is placed
by its side records: a live lease is restored with its deadline, a lease whose
deadline passed while the broker was down counts as an expired delivery
(attempt + 1, ready again), a delayed retry keeps its due time, and everything
else is ready. Scanning messages in key order, which is UUIDv7 order, rebuilds
each fairness key's FIFO order and so the DRR rings; deficits start at zero.
Records of queues that no longer exist are deleted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fila.core.broker import Broker
from fila.core.queue import QueueRecord
from fila.core.records import Lease, MessageRef
from fila.storage import keys
from fila.storage.store import scan
from fila.v1 import messages_pb2

log = logging.getLogger("fila.recovery")


@dataclass(slots=True)
class RecoveryReport:
    queues: int = 0
    ready: int = 0
    leased: int = 0
    expired: int = 0
    delayed: int = 0
    orphans: int = 0


def recover(broker: Broker) -> RecoveryReport:
    db, committer = broker.db, broker.committer
    report = RecoveryReport()
    for _, raw in scan(db, keys.QUEUE):
        broker.add_recovered_queue(QueueRecord.decode(raw))
        report.queues += 1
    for raw_key, raw_value in scan(db, keys.CONFIG):
        broker.recovered_config(keys.config_name_from_key(raw_key), raw_value.decode())

    leases = {
        keys.message_key_from_side_key(k): keys.decode_lease(v) for k, v in scan(db, keys.LEASE)
    }
    dues = {keys.message_key_from_side_key(k): keys.decode_due(v) for k, v in scan(db, keys.DELAY)}
    now = broker.clock.now_ms()
    last_key = b""
    for key, record in scan(db, keys.MESSAGE):
        last_key = key
        message = messages_pb2.Message.FromString(record)
        meta = message.metadata
        queue = broker.queues.get(meta.queue_id)
        lease = leases.pop(key, None)
        due = dues.pop(key, None)
        if queue is None:
            committer.delete(key)
            committer.delete(keys.lease_key(key))
            committer.delete(keys.delay_key(key))
            report.orphans += 1
            continue
        ref = MessageRef(
            key,
            message.id,
            meta.fairness_key or "default",
            meta.weight or 1,
            tuple(meta.throttle_keys),
            meta.attempt_count,
        )
        if lease is not None:
            deadline_ms, leased_at_ms = lease
            if deadline_ms > now:
                restored = Lease(ref, record, deadline_ms, leased_at_ms, None)
                restored.sent = True
                queue.leases[ref.id] = restored
                broker.schedule_expiry(queue, restored)
                report.leased += 1
                continue
            ref.attempt_count += 1
            meta.attempt_count = ref.attempt_count
            committer.put(key, message.SerializeToString())
            committer.delete(keys.lease_key(key))
            report.expired += 1
        elif due is not None:
            broker.schedule_due(queue, ref, due)
            report.delayed += 1
            continue
        queue.drr.push(ref, fresh=True)
        report.ready += 1
    if last_key:
        broker.ids.advance_past(last_key[1:])
    for key in (*leases, *dues):  # side records whose message is gone
        committer.delete(keys.lease_key(key))
        committer.delete(keys.delay_key(key))
    committer.flush_now()
    broker.mark_all_dirty()
    log.info(
        "recovered queues=%d ready=%d leased=%d expired=%d delayed=%d orphans=%d",
        report.queues,
        report.ready,
        report.leased,
        report.expired,
        report.delayed,
        report.orphans,
    )
    return report
