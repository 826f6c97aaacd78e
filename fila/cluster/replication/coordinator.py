"""The protocol's proposals as etcd transactions (`ports.Coordinator`).

Each proposal is one `Etcd.swap`: the new record is put only if the record is still
the value it was decided on (and, for an election, if the old leader's membership key
no longer holds the old lease; for an ISR addition, if each added replica's key still
holds the lease of the incarnation that caught up). The answer's record goes into the
mirror first, in etcd's revision order like every other change
(`fila.cluster.mirror`), so placements, routing and the protocol see it at once; then
the protocol hears the outcome. An etcd that does not answer makes an outcome the
protocol knows to be unknown (the watch tells it what became of the proposal)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fila.cluster.etcd import Etcd, EtcdUnavailable
from fila.cluster.layout import Layout, Placement
from fila.cluster.mirror import Mirror
from fila.cluster.replication.ports import Outcome, Proposal

log = logging.getLogger("fila.cluster.replication")


class EtcdCoordinator:
    def __init__(self, etcd: Etcd, layout: Layout, mirror: Mirror) -> None:
        self._etcd = etcd
        self._layout = layout
        self._mirror = mirror
        self._decided: Callable[[str, Outcome], None] = lambda group, outcome: None
        self._tasks: set[asyncio.Task[None]] = set()

    def connect(self, decided: Callable[[str, Outcome], None]) -> None:
        self._decided = decided

    def propose(self, proposal: Proposal) -> None:
        task = asyncio.get_running_loop().create_task(
            self._transact(proposal), name=f"fila-replication-propose-{proposal.group}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _transact(self, proposal: Proposal) -> None:
        key = self._layout.queue(proposal.group)
        gone = proposal.leader_gone
        try:
            swapped = await self._etcd.swap(
                key,
                None if proposal.expected is None else proposal.expected.stored(),
                proposal.record.encode(),
                not_on_lease=None if gone is None else (self._layout.node(gone[0]), gone[1]),
                on_leases=[(self._layout.node(node), lease) for node, lease in proposal.members_on],
            )
        except EtcdUnavailable as exc:
            log.warning("etcd did not answer a proposal for queue %s: %s", proposal.group, exc)
            self._decided(proposal.group, Outcome(proposal.token, False, None, known=False))
            return
        entry = swapped.entry
        if entry is None:
            self._mirror.apply(key, None, swapped.revision)
        else:
            self._mirror.apply(key, entry.value, entry.mod_revision)
        record = None if entry is None else Placement.decode(entry.value)
        self._decided(proposal.group, Outcome(proposal.token, swapped.swapped, record))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
