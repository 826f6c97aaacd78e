"""The committer's batch hook in cluster mode (`fila.storage.committer`): each write
batch is split by the replicated queue each operation belongs to; every queue this
node leads gets its part sequenced and streamed (`Replicator.written`), and its
position is written in the same batch. The batch's writers then wait on a `BatchGate`
over those tickets: answered once every part may be answered (the first error
otherwise), and what the batch made ready is served once every part is replicated."""

from __future__ import annotations

from collections.abc import Callable

from fila.cluster.layout import placed_name
from fila.cluster.replication.ports import Ticket
from fila.cluster.replication.replicator import Replicator
from fila.storage import keys
from fila.storage.backend import Batch


class ReplicationHook:
    def __init__(self, replicator: Replicator) -> None:
        self._replicator = replicator

    def __call__(self, batch: Batch, tags: list[str | None]) -> BatchGate | None:
        replicator = self._replicator
        parts: dict[str, list[tuple[bytes, bytes | None]]] = {}
        led: dict[str, bool] = {}
        for op, tag in zip(batch.ops, tags, strict=False):
            if tag is None:
                continue
            group = placed_name(tag)
            leads = led.get(group)
            if leads is None:
                leads = led[group] = replicator.leads(group)
            if leads:
                parts.setdefault(group, []).append(op)
        if not parts:
            return None
        tickets: list[Ticket] = []
        for group, ops in parts.items():
            ticket = replicator.written(group, tuple(ops))
            position = replicator.position(group)
            if ticket is None or position is None:
                continue
            batch.put(keys.replica_key(group), position.encode())
            tickets.append(ticket)
        return BatchGate(tickets, replicator.applied) if tickets else None


class BatchGate:
    """One committer batch's tickets, as the committer's `Gate`."""

    __slots__ = ("_applied", "_tickets")

    def __init__(self, tickets: list[Ticket], applied: Callable[[str, int], None]) -> None:
        self._tickets = tickets
        self._applied = applied

    def synced(self) -> None:
        for ticket in self._tickets:
            self._applied(ticket.group, ticket.seq)

    def when_answered(self, callback: Callable[[Exception | None], None]) -> None:
        waiting = [len(self._tickets)]
        failed: list[Exception] = []

        def answered(error: Exception | None) -> None:
            if error is not None and not failed:
                failed.append(error)
            waiting[0] -= 1
            if waiting[0] == 0:
                callback(failed[0] if failed else None)

        for ticket in self._tickets:
            ticket.when_answered(answered)

    def when_replicated(self, callback: Callable[[], None]) -> None:
        waiting = [len(self._tickets)]

        def replicated() -> None:
            waiting[0] -= 1
            if waiting[0] == 0:
                callback()

        for ticket in self._tickets:
            ticket.when_replicated(replicated)
