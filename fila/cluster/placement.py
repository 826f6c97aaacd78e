"""Where each queue lives: the mirrored `<prefix>/queues/` section, and the writes
that change it.

Every queue (with its DLQ) has one owner node, chosen when the queue is created:
the live node owning the fewest queues, the lowest node id among equals (`choose`).
The owner records it in etcd with a create-if-absent transaction (`claim`) before it
creates the queue locally, so queue names are unique across the cluster and of two
concurrent creates of one name exactly one wins; the owner deletes the record
(`release`) after it deleted the queue locally. An unreplicated queue's placement
never moves: a dead owner's queues wait for it.

With `[cluster] replication_factor` > 1 a queue is created on a replica set: the
chosen owner leads it, and the live nodes holding the fewest replicas follow it
(`choose_followers`). Its record then also holds the replicas, the in-sync set
(at first the leader alone), the epoch and the leader's lease; from then on only
the replication protocol changes it (`fila.cluster.replication`), and listeners
(`subscribe`) hear of every change.

`reconcile` repairs the two ways a crash can leave etcd and a node's disk out of
step, at startup, before the node serves: a queue on disk with no placement (created
before the data directory joined a cluster, or a lost claim) is claimed for this
node; a placement naming this node with no queue on disk (a crash between claim and
create, or between delete and release) is released. Replicated queues are left to
the replication protocol, which knows their replicas.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable

from fila.clock import Clock
from fila.cluster.etcd import Etcd
from fila.cluster.layout import Layout, Placement, placed_name
from fila.cluster.mirror import Mirror
from fila.core.errors import QueueAlreadyExists

log = logging.getLogger("fila.cluster")


class Placements:
    """Queue name -> owner; a mirror `Section` plus the writes of this node."""

    def __init__(self, etcd: Etcd, layout: Layout, mirror: Mirror, clock: Clock) -> None:
        self._etcd = etcd
        self._layout = layout
        self._mirror = mirror
        self._clock = clock
        self._owners: dict[str, Placement] = {}
        # Names this node is creating: claimed in etcd, not yet on disk (see reconcile).
        self.creating: set[str] = set()
        self._listeners: list[Callable[[str, Placement | None], None]] = []

    def subscribe(self, listener: Callable[[str, Placement | None], None]) -> None:
        """`listener(name, placement)` on every change (None: released), in etcd's order."""
        self._listeners.append(listener)

    def get(self, queue: str) -> Placement | None:
        """The placement covering `queue` (a DLQ: its queue's)."""
        return self._owners.get(placed_name(queue))

    def owner(self, queue: str) -> int | None:
        """The node owning `queue` (a DLQ: its queue's), None if etcd has no such queue."""
        found = self._owners.get(placed_name(queue))
        return None if found is None else found.node_id

    def names(self) -> list[str]:
        return sorted(self._owners)

    def counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for placement in self._owners.values():
            counts[placement.node_id] = counts.get(placement.node_id, 0) + 1
        return counts

    def choose(self, live: Iterable[int]) -> int:
        """The live node owning the fewest queues (the lowest id among equals)."""
        counts = self.counts()
        return min(live, key=lambda node_id: (counts.get(node_id, 0), node_id))

    def replica_counts(self) -> dict[int, int]:
        """Queues each node holds a copy of (leading or following)."""
        counts: dict[int, int] = {}
        for placement in self._owners.values():
            for node_id in placement.replicas or (placement.node_id,):
                counts[node_id] = counts.get(node_id, 0) + 1
        return counts

    def choose_followers(self, live: Iterable[int], leader: int, count: int) -> list[int]:
        """`count` live nodes other than `leader` holding the fewest replicas (the
        lowest ids among equals); fewer if there are not that many."""
        counts = self.replica_counts()
        others = sorted(
            (node_id for node_id in live if node_id != leader),
            key=lambda node_id: (counts.get(node_id, 0), node_id),
        )
        return others[:count]

    async def claim(
        self, name: str, node_id: int, *, followers: tuple[int, ...] = (), lease: int = 0
    ) -> None:
        """Records `node_id` as the owner of `name` (with `followers`: the leader of a
        replicated queue, whose etcd lease is `lease`); QueueAlreadyExists if it has one.
        Raises EtcdUnavailable when etcd cannot tell."""
        placement = Placement(node_id, uuid.uuid4().hex, self._clock.now_ms())
        if followers:
            placement = Placement(
                node_id,
                placement.claim,
                placement.created_at_ms,
                replicas=(node_id, *followers),
                isr=(node_id,),
                epoch=1,
                leader_lease=lease,
                version=1,
            )
        key = self._layout.queue(name)
        created = await self._etcd.create(key, placement.encode())
        if not created.created:
            entry = created.entry
            ours = entry is not None and _claim_of(entry.value) == placement.claim
            if not ours:  # (a retried transaction whose first answer was lost is ours)
                if entry is not None:
                    self._mirror.apply(key, entry.value, entry.mod_revision)
                raise QueueAlreadyExists(name)
        self._mirror.apply(key, placement.encode(), created.revision)

    async def release(self, name: str) -> None:
        key = self._layout.queue(name)
        revision = await self._etcd.delete(key)
        self._mirror.apply(key, None, revision)

    async def reconcile(self, node_id: int, local: Iterable[str]) -> None:
        """See the module docstring; `local` are the (non-DLQ) queues on this node's disk."""
        on_disk = set(local)
        for name in sorted(on_disk):
            owner = self.owner(name)
            if owner is None:
                log.warning("queue %s is on disk but not placed in etcd: claiming it", name)
                try:
                    await self.claim(name, node_id)
                except QueueAlreadyExists:
                    owner = self.owner(name)
            if owner is not None and owner != node_id:
                log.error(
                    "queue %s is on this node's disk but etcd places it on node %d: this "
                    "node's copy is not served (delete one of them)",
                    name,
                    owner,
                )
        for name, placement in sorted(self._owners.items()):
            if placement.node_id == node_id and name not in on_disk and not placement.replicated:
                log.warning(
                    "queue %s is placed on this node in etcd but not on its disk (a crash "
                    "between placement and creation, or after deletion): releasing it",
                    name,
                )
                await self.release(name)

    # Section

    def put(self, name: str, value: bytes) -> None:
        try:
            placement = Placement.decode(value)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            log.error("unreadable placement of queue %s in etcd ignored: %s", name, exc)
            return
        self._owners[name] = placement
        for listener in self._listeners:
            listener(name, placement)

    def delete(self, name: str) -> None:
        if self._owners.pop(name, None) is not None:
            for listener in self._listeners:
                listener(name, None)


def _claim_of(raw: bytes) -> str | None:
    try:
        return Placement.decode(raw).claim
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        return None
