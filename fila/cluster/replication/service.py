"""Replication on one node, wired: the protocol (`replicator.Replicator`) fed by the
cluster's state and acting through the real ports. `fila.cluster.node` owns it.

    etcd watch (Placements, Nodes), this node's lease  -> record_changed, node_changed,
                                                          lease_changed
    Follow streams (transport)                         -> received, lost
    the committer's batch hook (gate)                  -> written; applied on fsync
    a tick every 100 ms                                -> tick

Life cycle: built with the node (nothing runs); `start()` once the node holds its
lease and has read etcd; `run()` ticks until cancelled; `close()` ends the streams.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable
from typing import Final

import grpc

from fila.cluster.errors import NoLeader
from fila.cluster.etcd import Etcd
from fila.cluster.layout import Layout, NodeRecord, Placement
from fila.cluster.lease import NodeLease
from fila.cluster.mirror import Mirror
from fila.cluster.nodes import Nodes
from fila.cluster.peers import Peers
from fila.cluster.placement import Placements
from fila.cluster.replication.coordinator import EtcdCoordinator
from fila.cluster.replication.gate import ReplicationHook
from fila.cluster.replication.host import BrokerHost
from fila.cluster.replication.removal import Removal, remove_node
from fila.cluster.replication.replicator import LOG_BYTES, Replicator, Settings
from fila.cluster.replication.store import ReplicaStore
from fila.cluster.replication.transport import GrpcTransport
from fila.core.broker import Broker
from fila.core.errors import BrokerError
from fila.storage.backend import Storage
from fila.storage.committer import Committer
from fila.telemetry.metrics import ReplicaGauge

log = logging.getLogger("fila.cluster.replication")

TICK_S: Final = 0.1
# Test seam (tests only): each queue's in-memory log holds this many bytes at most, so
# that a test can make a follower need a snapshot without writing 64 MiB first.
LOG_BYTES_ENV: Final = "FILA_REPLICATION_LOG_BYTES"


class _LeaseFence:
    """`ports.Fence` on the node's lease."""

    def __init__(self, lease: NodeLease) -> None:
        self._lease = lease

    @property
    def lease(self) -> int:
        return self._lease.lease

    def serving(self) -> bool:
        return self._lease.serving


class Replication:
    def __init__(
        self,
        *,
        node_id: int,
        lag_ms: int,
        replication_factor: int,
        broker: Broker,
        storage: Storage,
        committer: Committer,
        lease: NodeLease,
        etcd: Etcd,
        layout: Layout,
        mirror: Mirror,
        nodes: Nodes,
        placements: Placements,
        peers: Peers,
        metadata: tuple[tuple[str, str], ...],
    ) -> None:
        self._placements = placements
        self._etcd, self._layout, self._mirror, self._nodes = etcd, layout, mirror, nodes
        self.factor = replication_factor  # for queues created on this node
        self.lag_ms = lag_ms
        self.coordinator = EtcdCoordinator(etcd, layout, mirror)
        self.transport = GrpcTransport(node_id, peers, nodes, metadata)
        log_bytes = int(os.environ.get(LOG_BYTES_ENV) or 0) or LOG_BYTES
        self.replicator = Replicator(
            node_id,
            Settings(lag_ms=lag_ms, log_bytes=log_bytes),
            broker.clock,
            _LeaseFence(lease),
            self.coordinator,
            self.transport,
            ReplicaStore(
                storage, committer, lambda group, seq: self.replicator.applied(group, seq)
            ),
            BrokerHost(broker, storage),
            lambda: secrets.randbits(63),
        )
        replicator = self.replicator
        self.coordinator.connect(replicator.decided)
        self.transport.connect(replicator.received, replicator.connection_lost)
        committer.set_hook(ReplicationHook(replicator))
        nodes.subscribe(_node_listener(replicator))
        placements.subscribe(replicator.record_changed)
        placements.subscribe(self._placement_changed)
        lease.subscribe(replicator.lease_changed)
        self._in_sync: dict[str, list[asyncio.Event]] = {}

    def start(self) -> None:
        """Acts on what etcd holds (call once the node has its lease and etcd's state)."""
        self.replicator.start()

    async def run(self) -> None:
        """Ticks the protocol until cancelled."""
        replicator = self.replicator
        while True:
            await asyncio.sleep(TICK_S)
            replicator.tick()

    def fenced(self) -> None:
        """The node's lease lapsed: what waits on it is answered now, not at the tick."""
        self.replicator.tick()

    def handler(self) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
        return self.transport.handler()

    async def close(self) -> None:
        await self.transport.close()
        await self.coordinator.close()

    # -- what routing and administration ask --------------------------------------------

    def serving(self, group: str) -> bool:
        return self.replicator.serving(group)

    def leads(self, group: str) -> bool:
        return self.replicator.leads(group)

    def unavailable(self, group: str) -> BrokerError:
        return self.replicator.unavailable(group)

    def no_leader(self, group: str, placement: Placement) -> NoLeader:
        return NoLeader(group, placement.isr)

    def follower_lag(self, group: str) -> dict[int, int]:
        return self.replicator.follower_lag(group)

    def replica_gauges(self) -> list[ReplicaGauge]:
        """The metrics' view (`fila.telemetry.metrics.ReplicationState`): read on the
        exporter's thread, from copies."""
        return [
            ReplicaGauge(group, replicas, in_sync, lag)
            for group, replicas, in_sync, lag in self.replicator.gauges()
        ]

    async def remove_node(self, node_id: int, discard: bool) -> Removal:
        """RemoveNode (see `removal`)."""
        return await remove_node(
            node_id,
            discard,
            etcd=self._etcd,
            layout=self._layout,
            mirror=self._mirror,
            nodes=self._nodes,
            placements=self._placements,
        )

    async def in_sync(self, group: str, timeout_s: float) -> None:
        """Returns once every replica of `group` is in its in-sync set, or after
        `timeout_s` (a new queue's followers catching up, see CreateQueue)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            placement = self._placements.get(group)
            if placement is None or set(placement.isr) >= set(placement.replicas):
                return
            left = deadline - loop.time()
            if left <= 0:
                log.warning(
                    "queue %s created without every replica in sync: in sync %s of %s",
                    group,
                    list(placement.isr),
                    list(placement.replicas),
                )
                return
            event = asyncio.Event()
            self._in_sync.setdefault(group, []).append(event)
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                pass
            finally:
                waiters = self._in_sync.get(group)
                if waiters is not None and event in waiters:
                    waiters.remove(event)
                    if not waiters:
                        del self._in_sync[group]

    def _placement_changed(self, group: str, placement: Placement | None) -> None:
        for event in self._in_sync.get(group, ()):
            event.set()


def _node_listener(replicator: Replicator) -> Callable[[int, NodeRecord | None], None]:
    def changed(node_id: int, record: NodeRecord | None) -> None:
        replicator.node_changed(node_id, None if record is None else record.lease)

    return changed
