"""Where a call is served: the one routing decision of cluster mode, and the table of
how each RPC is routed.

`Router.target(queue)` answers, for every call on a queue and every item of a batch:

    LOCAL         this node owns the queue and holds its lease: serve it here. Also
                  for a queue etcd does not know (or a malformed name), so that the
                  local broker gives exactly the single-node answer (NOT_FOUND,
                  INVALID_ARGUMENT) and ACL checks keep their single-node order;
                  but only while this node holds its lease;
    NodeRecord    the live owner: forward to it (or, for a consume, redirect);

or raises: `Fenced` (this node would serve the call but has no lease: it serves
nothing, SPEC 9, whatever its view of etcd says, which may be stale: while it had no
lease a replacement with its id may have released its queues), `OwnerDown` (the owner
is not a live member), `NotOwner` (a forwarded call reached a node that does not own
the queue: answered, never forwarded twice). A queue the mirror does not know is
looked up in etcd first (`Mirror.refresh`), so a queue created through another node
is found at once; a name etcd did not know is not asked about again for a moment
(`fila.cluster.unknown`). Callers check the caller's permission on the queue before
they ask (the auth interceptor for calls on one queue, the edge and the stream
splitter for each item): a queue the caller may not touch is never looked up.

A replicated queue (`fila.cluster.replication`) is served by its leader while the
replication protocol says it leads it and may serve; its record names the leader and
the lease it held: a named leader that is down, or a later incarnation of it (which
leads nothing until an election), means the queue has no leader for now (`NoLeader`,
naming the in-sync replicas it waits for), and a leader elected a moment ago that is
still rebuilding the queue says so (`TakingOver`).

`ROUTES` says, per method, which shape of routing applies; `fila.cluster.edge`
carries it out. A test checks it covers every method of both services, as
`fila.server.access.RULES` does, so a new RPC cannot bypass routing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Final, Protocol

from fila.clock import Clock
from fila.cluster.errors import NoLeader, NotOwner, OwnerDown
from fila.cluster.layout import Layout, NodeRecord, Placement, placed_name
from fila.cluster.lease import NodeLease
from fila.cluster.mirror import Mirror
from fila.cluster.nodes import Nodes
from fila.cluster.placement import Placements
from fila.cluster.unknown import UnknownQueues
from fila.core.errors import BrokerError, InvalidArgument
from fila.core.queue import validate_queue_name


class Replicas(Protocol):
    """What routing asks the replication protocol (`fila.cluster.replication`)."""

    def serving(self, group: str) -> bool: ...

    def leads(self, group: str) -> bool: ...

    def unavailable(self, group: str) -> BrokerError: ...


class Local(Enum):
    LOCAL = "local"


LOCAL: Final = Local.LOCAL
Target = Local | NodeRecord


class Router:
    def __init__(
        self,
        node_id: int,
        lease: NodeLease,
        placements: Placements,
        nodes: Nodes,
        mirror: Mirror,
        layout: Layout,
        clock: Clock,
        replicas: Replicas | None = None,
    ) -> None:
        self.node_id = node_id
        self._replicas = replicas
        self._lease = lease
        self._placements = placements
        self._nodes = nodes
        self._mirror = mirror
        self._layout = layout
        self.unknown = UnknownQueues(clock)

    async def target(self, queue: str, *, forwarded: bool) -> Target:
        """See the module docstring. Raises EtcdUnavailable when the queue is unknown
        here and etcd cannot be asked."""
        owner = self._placements.owner(queue)
        if owner is None and _valid(queue):
            name = placed_name(queue)
            if not self.unknown.known_unknown(name):
                await self._mirror.refresh(self._layout.queue(name))
                owner = self._placements.owner(queue)
                if owner is None:
                    self.unknown.note(name)
        return self.decide(queue, owner, forwarded=forwarded)

    def decide(self, queue: str, owner: int | None, *, forwarded: bool) -> Target:
        if self._replicas is not None and owner is not None:
            placement = self._placements.get(queue)
            if placement is not None and placement.replicated:
                return self._decide_replicated(queue, placement, forwarded=forwarded)
        if owner is None or owner == self.node_id:
            if not self._lease.serving:
                raise self._lease.fenced_error()
            return LOCAL
        if forwarded:
            raise NotOwner(queue, self.node_id, owner)
        node = self._nodes.get(owner)
        if node is None:
            raise OwnerDown(placed_name(queue), owner)
        return node

    def _decide_replicated(self, queue: str, placement: Placement, *, forwarded: bool) -> Target:
        assert self._replicas is not None
        group = placed_name(queue)
        if placement.node_id == self.node_id or self._replicas.leads(group):
            if self._replicas.serving(group):
                return LOCAL
            if not self._lease.serving:
                raise self._lease.fenced_error()
            raise self._replicas.unavailable(group)
        if forwarded:
            raise NotOwner(queue, self.node_id, placement.node_id)
        node = self._nodes.get(placement.node_id)
        if node is None or (node.lease and node.lease != placement.leader_lease):
            raise NoLeader(group, placement.isr)
        return node


def _valid(queue: str) -> bool:
    try:
        validate_queue_name(placed_name(queue))
    except InvalidArgument:
        return False
    return True


class Route(Enum):
    QUEUE = "queue"  # unary on one queue (request field `field`): here, or forwarded
    ITEMS = "items"  # unary batch: items (repeated field `field`) split by owner, merged
    STREAM_ITEMS = "stream_items"  # StreamEnqueue: each request split by owner
    REDIRECT = "redirect"  # Consume/StreamConsume: here, or UNAVAILABLE + x-fila-leader-addr
    EVERY_NODE = "every_node"  # ListQueues: every node's own queues, merged
    PLACE = "place"  # CreateQueue: choose the owner, which claims the name in etcd
    DELETE = "delete"  # DeleteQueue: QUEUE, and the owner releases the placement
    CONFIG_WRITE = "config_write"  # SetConfig: to etcd, then mirrored by every node
    FRESH = "fresh"  # a read of shared state: refresh it from etcd, then answer here
    LOCAL = "local"  # answered here (API key writes go to etcd through the KeyStore)
    CLUSTER = "cluster"  # ClusterStatus: this node's view of the cluster
    REMOVE_NODE = "remove_node"  # RemoveNode: a gone node's replicas moved, in etcd


class Reads(Enum):
    """What a FRESH call reads, refreshed from etcd before it is answered."""

    CONFIG_KEY = "config_key"  # GetConfig: request.key
    CONFIG = "config"  # ListConfig: every config key under request.prefix
    KEY_ID = "key_id"  # RevokeApiKey, SetAcl, GetAcl: request.key_id's record and ACL
    KEYS = "keys"  # ListApiKeys: every key and ACL


@dataclass(frozen=True, slots=True)
class Rule:
    route: Route
    field: str = ""
    reads: Reads | None = None


_S: Final = "/fila.v1.FilaService/"
_A: Final = "/fila.v1.FilaAdmin/"

ROUTES: Final[Mapping[str, Rule]] = {
    _S + "Enqueue": Rule(Route.QUEUE, "queue"),
    _S + "EnqueueBatch": Rule(Route.ITEMS, "messages"),
    _S + "StreamEnqueue": Rule(Route.STREAM_ITEMS, "messages"),
    _S + "Consume": Rule(Route.REDIRECT, "queue"),
    _S + "StreamConsume": Rule(Route.REDIRECT, "queue"),  # the first request names it
    _S + "Ack": Rule(Route.QUEUE, "queue"),
    _S + "Nack": Rule(Route.QUEUE, "queue"),
    _S + "AckBatch": Rule(Route.ITEMS, "acks"),
    _S + "NackBatch": Rule(Route.ITEMS, "nacks"),
    _S + "ExtendLease": Rule(Route.QUEUE, "queue"),
    _A + "CreateQueue": Rule(Route.PLACE, "name"),
    _A + "DeleteQueue": Rule(Route.DELETE, "queue"),
    _A + "ListQueues": Rule(Route.EVERY_NODE),
    _A + "GetStats": Rule(Route.QUEUE, "queue"),
    _A + "Redrive": Rule(Route.QUEUE, "dlq_queue"),  # a DLQ lives with its queue
    _A + "PeekMessages": Rule(Route.QUEUE, "queue"),
    _A + "PurgeQueue": Rule(Route.QUEUE, "queue"),
    _A + "GetQueue": Rule(Route.QUEUE, "queue"),
    _A + "UpdateQueue": Rule(Route.QUEUE, "queue"),
    _A + "SetConfig": Rule(Route.CONFIG_WRITE),
    _A + "GetConfig": Rule(Route.FRESH, reads=Reads.CONFIG_KEY),
    _A + "ListConfig": Rule(Route.FRESH, reads=Reads.CONFIG),
    _A + "CreateApiKey": Rule(Route.LOCAL),
    _A + "RevokeApiKey": Rule(Route.FRESH, reads=Reads.KEY_ID),
    _A + "ListApiKeys": Rule(Route.FRESH, reads=Reads.KEYS),
    _A + "SetAcl": Rule(Route.FRESH, reads=Reads.KEY_ID),
    _A + "GetAcl": Rule(Route.FRESH, reads=Reads.KEY_ID),
    _A + "ClusterStatus": Rule(Route.CLUSTER),
    _A + "RemoveNode": Rule(Route.REMOVE_NODE),
}
