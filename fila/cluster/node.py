"""A cluster node, wired: the one object `fila.server.main` deals with in cluster mode.

Life cycle, and why in this order:

    node = ClusterNode(config, broker, storage, committer)   # nothing talks to etcd yet
    await node.start()        # before the gRPC server listens: check this data
                              # directory's node id, join (lease and membership key),
                              # read the shared state, reconcile placements. Nothing
                              # is served before the node holds its lease.
    task = create_task(node.run())   # renew the lease, follow etcd; owned by main,
                                     # cancelled at shutdown
    await node.leave()        # at shutdown, first: revoking the lease makes the other
                              # nodes stop forwarding here at once
    await node.close()        # channels to peers and to etcd, after the server stopped
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Final

import grpc
import grpc.aio

from fila.clock import SystemClock
from fila.cluster import layout as sections
from fila.cluster.address import Addresses
from fila.cluster.edge import Edge
from fila.cluster.etcd import Etcd, EtcdUnavailable
from fila.cluster.identity import Identity
from fila.cluster.layout import Layout, NodeRecord
from fila.cluster.lease import NodeLease
from fila.cluster.mirror import Mirror
from fila.cluster.nodes import Nodes
from fila.cluster.peers import Peers
from fila.cluster.placement import Placements
from fila.cluster.replication.service import Replication
from fila.cluster.routing import Router
from fila.cluster.shared import EtcdKeyStore, KeyMirror, SharedConfig, find_key
from fila.config import Config
from fila.core.broker import Broker
from fila.core.errors import BrokerError
from fila.security.keyring import Keyring
from fila.server.readers import StreamReaders
from fila.storage import keys
from fila.storage.backend import Storage
from fila.storage.committer import Committer

log = logging.getLogger("fila.cluster")

# How long startup waits for etcd, and for a previous holder of this node id to go.
JOIN_PATIENCE_S: Final = 15.0


class ClusterNode:
    def __init__(self, config: Config, broker: Broker, storage: Storage, committer: Committer):
        cluster = config.cluster
        self.node_id = cluster.node_id
        self._addr = cluster.advertise_addr
        self._addresses = Addresses()
        self._checks: set[asyncio.Task[None]] = set()
        self._broker = broker
        self._storage = storage
        self._etcd = Etcd(cluster.etcd_endpoints)
        self.layout = Layout(cluster.etcd_prefix)
        self.mirror = Mirror(self._etcd, self.layout.root)
        self.nodes = Nodes()
        self.placements = Placements(self._etcd, self.layout, self.mirror, broker.clock)
        self.lease = NodeLease(
            self._etcd,
            self.layout,
            NodeRecord(self.node_id, cluster.advertise_addr, broker.clock.now_ms()),
            cluster.lease_ttl_ms,
            Identity(storage, committer),
            self._fenced,
            self._addresses,
        )
        self.config = SharedConfig(self._etcd, self.layout, self.mirror, broker)
        store = EtcdKeyStore(self._etcd, self.layout, self.mirror)
        self.keyring = Keyring(store, SystemClock(), config.auth.bootstrap_apikey)
        key_mirror = KeyMirror(self.keyring)
        self.peers = Peers(self.node_id, peer_credentials(config))
        bootstrap = config.auth.bootstrap_apikey
        self.replication = Replication(
            node_id=self.node_id,
            lag_ms=cluster.lease_ttl_ms,
            replication_factor=cluster.replication_factor,
            broker=broker,
            storage=storage,
            committer=committer,
            lease=self.lease,
            etcd=self._etcd,
            layout=self.layout,
            mirror=self.mirror,
            nodes=self.nodes,
            placements=self.placements,
            peers=self.peers,
            metadata=(("authorization", f"Bearer {bootstrap}"),) if bootstrap else (),
        )
        self.router = Router(
            self.node_id,
            self.lease,
            self.placements,
            self.nodes,
            self.mirror,
            self.layout,
            broker.clock,
            self.replication,
        )
        self.mirror.add(sections.NODES, self.nodes)
        self.mirror.add(sections.QUEUES, self.placements)
        self.mirror.add(sections.CONFIG, self.config.section())
        self.mirror.add(sections.API_KEYS, key_mirror.keys_section())
        self.mirror.add(sections.ACLS, key_mirror.acls_section())
        self.nodes.subscribe(self.peers.node_changed)
        self.nodes.subscribe(self._node_changed)
        self._revision = 0

    async def start(self) -> None:
        """Joins the cluster (see the module docstring). Raises BrokerError subclasses
        (IdentityMismatch, NodeIdTaken, AddressTaken, EtcdUnavailable) worded for the
        operator."""
        Identity(self._storage, self._broker.committer).claim_node_id(self.node_id)
        await self._etcd.open()
        self.config.forget_local()
        if next(iter(self._storage.scan(keys.API_KEY)), None) is not None:
            log.warning(
                "API keys in this node's storage are ignored: in cluster mode they live in etcd"
            )
        await self.lease.acquire(JOIN_PATIENCE_S)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + JOIN_PATIENCE_S
        while True:
            try:
                self._revision = await self.mirror.snapshot()
                break
            except EtcdUnavailable:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.5)
        local = [q.name for q in self._broker.queues.values() if not q.record.dlq_of]
        await self.placements.reconcile(self.node_id, local)
        self.replication.start()
        log.info(
            "cluster state loaded node=%d nodes_up=%d queues=%d revision=%d",
            self.node_id,
            len(self.nodes),
            len(self.placements.names()),
            self._revision,
        )

    def interceptors(
        self, readers: StreamReaders | None = None
    ) -> list[grpc.aio.ServerInterceptor]:  # type: ignore[type-arg]
        """`readers`: where producers' StreamEnqueue calls wait for requests, so that
        the shutdown can end them."""
        return [
            Edge(
                router=self.router,
                peers=self.peers,
                placements=self.placements,
                nodes=self.nodes,
                lease=self.lease,
                config=self.config,
                mirror=self.mirror,
                layout=self.layout,
                broker=self._broker,
                replication=self.replication,
                readers=readers,
            )
        ]

    async def find_key(self, presented: str) -> None:
        """The auth interceptor's second chance for a key this node has not seen."""
        await find_key(self._etcd, self.layout, self.mirror, presented)

    async def run(self) -> None:
        """Renews the lease and follows etcd until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self.lease.run(), name="fila-cluster-lease")
            group.create_task(self.mirror.run(self._revision), name="fila-cluster-mirror")
            group.create_task(self.replication.run(), name="fila-cluster-replication")

    async def leave(self) -> None:
        await self.lease.release()

    def replication_handler(self) -> grpc.GenericRpcHandler:  # type: ignore[type-arg]
        """The Follow service other nodes replicate through (`fila.internal.v1`)."""
        return self.replication.handler()

    async def close(self) -> None:
        for check in self._checks:
            check.cancel()
        await self.replication.close()
        await self.peers.close()
        await self.mirror.close()
        await self._etcd.close()

    def _fenced(self, reason: BrokerError) -> None:
        """The lease lapsed: consume streams end, and replicated writes waiting on this
        node are answered (not acknowledged)."""
        self._broker.end_consumers(reason)
        self.replication.fenced()

    def _node_changed(self, node_id: int, record: NodeRecord | None) -> None:
        if node_id == self.node_id and record is None and self.lease.serving:
            self.lease.key_deleted()
        if record is not None and node_id != self.node_id:
            # A listener is called synchronously; comparing may resolve a name.
            check = asyncio.get_running_loop().create_task(self._check_address(record))
            self._checks.add(check)
            check.add_done_callback(self._checks.discard)

    async def _check_address(self, record: NodeRecord) -> None:
        """Startup refuses a node at a live node's address (fila.cluster.lease), but two
        nodes starting at once both find it free: say so loudly, on both."""
        if await self._addresses.same(self._addr, record.advertise_addr):
            log.error(
                "node %d advertises this node's address %s (as %s): calls the others "
                "forward to either node may reach the other; give each node its own "
                "advertise_addr",
                record.node_id,
                self._addr,
                record.advertise_addr,
            )


def peer_credentials(config: Config) -> grpc.ChannelCredentials | None:
    """How this node reaches the others: as clients do. With TLS, peers are verified
    with `tls.ca_file` (else the system roots), and with mTLS (a `ca_file`) this node
    presents its own certificate."""
    tls = config.tls
    if not tls.cert_file:
        return None
    if not tls.ca_file:
        return grpc.ssl_channel_credentials()
    return grpc.ssl_channel_credentials(
        root_certificates=Path(tls.ca_file).read_bytes(),
        private_key=Path(tls.key_file).read_bytes(),
        certificate_chain=Path(tls.cert_file).read_bytes(),
    )
