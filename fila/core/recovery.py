"""Rebuilds the broker's in-memory state from storage at startup.

Runs before the server accepts connections. Runtime config comes back first (a
queue's scripts may read it as they load; throttle buckets start full), then the
queues, then every stored message is placed by its side records: a lease is
restored with its deadline (one that passed while the broker was down expires on the
timers' first run, through `Settlement` like any expiry: an attempt counted, the
retry policy applied), a delayed message keeps its due time, and everything else is
ready. A lease or a delay that began in this run's
future (the clock was stepped back between runs) lasts at most its whole length from
now (`_within_length`). Scanning messages in key order, which is UUIDv7 order,
rebuilds each fairness key's FIFO order and so the DRR rings; deficits start at zero.

Nothing is deleted because something else could not be read. Every scan either
reads everything or raises `CorruptionError` (see `fila.storage.backend`: storage
that fails its checksums stops the start, and `fila-server --repair` salvages it).
A record that reads back but does not decode is set aside whole
(`fila.core.quarantine`), logged and counted, and the broker starts without it:
one bad record must not keep every good one offline. A message whose queue does
not exist is left where it is and reported, never deleted: no normal operation
produces one (a queue's messages are deleted in the same atomic batch as the
queue), so it means damage.
A dead-letter queue whose queue does not exist is such damage too (a queue and its
DLQ are created and deleted together): it is restored as the ordinary queue it is,
with its messages, and reported; creating its queue again adopts it, and deleting
it alone is allowed (see `Administration`). The reverse, a queue whose DLQ's record
was lost, is repaired here: the DLQ cannot be created by hand (".dlq" names are
reserved), and without it a nack to "dlq" retries instead and the DLQ's stored
messages are unreachable. So its record is derived from the queue's exactly as
CreateQueue derives it, written back, and logged; its messages, which name it as
their queue, are then placed like any other. Before either check, a record whose
dead-letter link (`dlq_of`) disagrees with its name is corrected from the name,
written back and logged (`_linked`): which queue is whose DLQ is decided there
alone, so every later step can go by the name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from fila.core import stored
from fila.core.administration import Administration, dlq_record
from fila.core.queue import QueueRecord
from fila.core.records import MessageRef
from fila.core.state import CoreState
from fila.storage import keys
from fila.wire import dlq_owner

log = logging.getLogger("fila.recovery")


@dataclass(slots=True)
class RecoveryReport:
    queues: int = 0
    ready: int = 0
    leased: int = 0
    expired: int = 0
    delayed: int = 0
    orphans: int = 0
    orphan_dlqs: list[str] = field(default_factory=list)
    recreated_dlqs: list[str] = field(default_factory=list)
    # (queue, the dlq_of its record stored) for records whose link disagreed with the name
    relinked_queues: list[tuple[str, str]] = field(default_factory=list)
    stale_side_records: int = 0
    # records set aside by this start because they do not decode (see fila.core.quarantine)
    quarantined: int = 0


def _linked(record: QueueRecord, records: dict[str, QueueRecord]) -> QueueRecord:
    """`record` with the dead-letter link its name implies (`dlq_owner`).

    A `q.dlq` whose record names another queue (or none) is still q's DLQ: q's nacks
    dead-letter into it by name, so its messages are q's. Left as stored, its
    Redrive would move q's dead letters into the queue it names, past the ACL check
    made on q, and q would never have its DLQ recreated. With q present it becomes
    the DLQ CreateQueue makes (`dlq_record`, as adopting an orphan does, keeping its
    creation time); without q only the link is corrected, and it is then an orphan
    DLQ like any other (served, reported, taken back by creating q). A record of a
    name without the suffix that claims to be a DLQ is made an ordinary queue again,
    which gets its own DLQ below if it has none."""
    owner = dlq_owner(record.name) or ""
    if record.dlq_of == owner:
        return record
    parent = records.get(owner) if owner else None
    if parent is not None:
        return dlq_record(parent, record.created_at_ms)
    return replace(record, dlq_of=owner)


def _within_length(end_ms: int, start_ms: int, now_ms: int) -> tuple[int, int]:
    """(end, start) of a stored wait (a lease, a delay) moved so that from `now_ms` it
    lasts at most its whole length: the clock stepped back between the run that
    stored it and this one (or the queue moved from a node whose clock ran ahead)
    when `start_ms` lies in the future. Kept as stored, a lease of 30 s after a step
    back of two hours would hold its message for two hours. A step forward needs no
    bound: the wait has ended, or ends sooner, as it would have by the wall clock."""
    if start_ms <= now_ms:
        return end_ms, start_ms
    return now_ms + (end_ms - start_ms), now_ms


def recover(
    state: CoreState, admin: Administration, *, held: Callable[[str], bool] | None = None
) -> RecoveryReport:
    """Rebuilds everything stored (at startup), but the queues `held` names: those are
    left on disk, not served (a cluster node's replica of a queue another node leads,
    served only once this node leads it: `recover_queues`)."""
    report = _restore(state, admin, held=held or (lambda name: False), startup=True)
    state.committer.flush_now()
    state.mark_all_dirty()
    _report(state, report)
    return report


def recover_queues(
    state: CoreState, admin: Administration, names: Collection[str]
) -> RecoveryReport:
    """Rebuilds the queues `names` from what is stored, as `recover` does at startup,
    while the broker runs: a cluster node that has just taken the lead of a replicated
    queue (its records were written here by the leader's replication). The repairs it
    writes (a lost DLQ record) are committed with the next batch."""
    wanted = frozenset(names)
    report = _restore(state, admin, held=lambda name: name not in wanted, startup=False)
    for name in wanted:
        queue = state.queues.get(name)
        if queue is not None:
            state.mark_dirty(queue)
    _report(state, report)
    return report


def _restore(
    state: CoreState, admin: Administration, *, held: Callable[[str], bool], startup: bool
) -> RecoveryReport:
    storage, committer = state.storage, state.committer
    quarantine = state.quarantine
    if startup:
        quarantine.count = sum(1 for _ in storage.scan(keys.QUARANTINE))
    set_aside_before = quarantine.count
    report = RecoveryReport()
    # Config first: a queue's scripts run as they load and may read it (`fila.get`).
    for raw_key, raw_value in storage.scan(keys.CONFIG) if startup else ():
        try:
            name, text = stored.decode_config(raw_key, raw_value)
        except stored.BadRecord as exc:
            quarantine.set_aside(committer, raw_key, raw_value, str(exc))
            continue
        admin.restore_config(name, text)
    records: dict[str, QueueRecord] = {}
    for raw_key, raw_queue in storage.scan(keys.QUEUE):
        if held(keys.queue_name_from_key(raw_key)):
            continue
        try:
            record = stored.decode_queue(raw_key, raw_queue)
        except stored.BadRecord as exc:
            quarantine.set_aside(committer, raw_key, raw_queue, str(exc))
            continue
        records[record.name] = record
    restored: list[str] = []
    for record in records.values():
        linked = _linked(record, records)
        if linked != record:
            # Written back, like a recreated DLQ: the next start reads it correct.
            committer.put(keys.queue_key(linked.name), linked.encode(), linked.name)
            report.relinked_queues.append((record.name, record.dlq_of))
        admin.restore_queue(linked)
        restored.append(linked.name)
        report.queues += 1
    # Before the messages are placed, so that those of a recreated DLQ find it.
    for owner in [state.queues[name] for name in restored]:
        dlq_name = owner.dlq_name
        if dlq_name is None or dlq_name in state.queues:
            continue
        # CreateQueue stamps a queue and its DLQ with the same time, so this is the
        # lost record itself (unless the DLQ was an adopted orphan: then only its
        # creation time differs). It is written, not just served: the next start
        # reads it as any other record and the warning is not repeated. Were the
        # write lost (a power cut before it is synced), the next recovery derives the
        # same record again, so nothing depends on which start wrote it.
        lost = dlq_record(owner.record, owner.record.created_at_ms)
        admin.restore_queue(lost)
        committer.put(keys.queue_key(lost.name), lost.encode(), lost.name)
        report.recreated_dlqs.append(lost.name)
        restored.append(lost.name)
    report.orphan_dlqs = [
        name
        for name in restored
        if state.queues[name].record.dlq_of and state.queues[name].record.dlq_of not in state.queues
    ]

    leases: dict[bytes, tuple[int, int]] = {}
    for side_key, value in storage.scan(keys.LEASE):
        try:
            leases[keys.message_key_from_side_key(side_key)] = stored.decode_lease(value)
        except stored.BadRecord as exc:
            quarantine.set_aside(committer, side_key, value, str(exc))
    dues: dict[bytes, int] = {}
    for side_key, value in storage.scan(keys.DELAY):
        try:
            dues[keys.message_key_from_side_key(side_key)] = stored.decode_due(value)
        except stored.BadRecord as exc:
            quarantine.set_aside(committer, side_key, value, str(exc))
    now = state.clock.now_ms()
    last_key = b""
    for key, raw in storage.scan(keys.MESSAGE):
        last_key = key
        lease = leases.pop(key, None)
        due = dues.pop(key, None)
        try:
            message = stored.decode_message(key, raw)
        except stored.BadRecord as exc:
            quarantine.set_aside(committer, key, raw, str(exc))
            if lease is not None:
                committer.delete(keys.lease_key(key))
            if due is not None:
                committer.delete(keys.delay_key(key))
            continue
        meta = message.metadata
        if held(meta.queue_id):
            continue  # another queue's, left as it is
        queue = state.queues.get(meta.queue_id)
        if queue is None:
            report.orphans += 1
            continue
        ref = MessageRef(
            key,
            meta.fairness_key or "default",
            meta.weight or 1,
            tuple(meta.throttle_keys),
            meta.attempt_count,
        )
        if lease is not None:
            deadline_ms, leased_at_ms = _within_length(*lease, now)
            queue.leases.restore(ref, deadline_ms, leased_at_ms)
            if deadline_ms > now:
                report.leased += 1
            else:
                report.expired += 1
            continue
        if due is not None:
            enqueued_ms = message.timestamps.enqueued_at.ToMilliseconds()
            due, _ = _within_length(due, enqueued_ms, now)
            queue.delayed[key] = ref
            state.schedule_release(queue, ref, due)
            report.delayed += 1
            continue
        queue.drr.push(ref, fresh=True)
        report.ready += 1
    report.quarantined = quarantine.count - set_aside_before
    if last_key:
        state.ids.advance_past(last_key[1:])
    if startup:  # side records whose message was deleted: useless alone
        for key in (*leases, *dues):
            committer.delete(keys.lease_key(key))
            committer.delete(keys.delay_key(key))
            report.stale_side_records += 1
    return report


def _report(state: CoreState, report: RecoveryReport) -> None:
    quarantine = state.quarantine
    log.info(
        "recovered",
        extra={
            "queues": report.queues,
            "ready": report.ready,
            "leased": report.leased,
            "expired": report.expired,
            "delayed": report.delayed,
            "quarantined": report.quarantined,
            "quarantined_in_all": quarantine.count,
        },
    )
    if report.orphans:
        log.error(
            "stored messages name a queue that does not exist; they were left untouched "
            "(a sign of damage: see 'Damaged data' in docs/operations.md)",
            extra={"messages": report.orphans},
        )
    for name, stored_dlq_of in report.relinked_queues:
        log.warning(
            "a queue record's dead-letter link disagreed with its name (a sign of damage); "
            "it was corrected from the name and written back",
            extra={"queue": name, "stored_dlq_of": stored_dlq_of, "dlq_of": dlq_owner(name) or ""},
        )
    for name in report.recreated_dlqs:
        dlq = state.queues[name]
        log.warning(
            "a queue's dead-letter queue had no record (it was lost: a sign of damage); "
            "it was recreated from the queue's configuration and its stored messages are "
            "served again",
            extra={
                "queue": dlq.record.dlq_of,
                "dlq": name,
                "messages": dlq.depth + len(dlq.leases),
            },
        )
    for name in report.orphan_dlqs:
        parent = state.queues[name].record.dlq_of
        log.error(
            "a dead-letter queue's queue does not exist (its record was lost: a sign of "
            "damage); create that queue again to take the DLQ back, or delete the DLQ",
            extra={"queue": name, "dlq_of": parent},
        )
