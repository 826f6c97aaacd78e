"""Cluster mode's queue administration, typed: where a queue is created (and, with
`replication_factor` > 1, on which replicas), how its deletion releases its
placement, how every node's queues are listed as one (with each one's leader,
replicas and in-sync set), what `ClusterStatus` answers, and `RemoveNode`.

The edge (`fila.cluster.edge`) only routes: it hands each admin call here with its
request decoded and the local handler (`local`), and maps a `BrokerError` to the
call's status. What a call means for the cluster (placement, claims in etcd, which
node answers) is decided here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc.aio

from fila.cluster.errors import OwnerDown
from fila.cluster.etcd import EtcdUnavailable
from fila.cluster.layout import NodeRecord, Placement
from fila.cluster.lease import NodeLease
from fila.cluster.nodes import Nodes
from fila.cluster.peers import Peers, is_forwarded
from fila.cluster.placement import Placements
from fila.cluster.replication.service import Replication
from fila.cluster.routing import LOCAL, Router
from fila.core.broker import Broker
from fila.core.errors import BrokerError, QueueAlreadyExists, QueueNotFound, Unavailable
from fila.core.queue import validate_queue_name
from fila.server import access
from fila.v1 import admin_pb2
from fila.wire import dlq_name, dlq_owner

log = logging.getLogger("fila.cluster")

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Req = TypeVar("Req")
Resp = TypeVar("Resp")
# The local handler of a call: its answer, or the answer's bytes (handlers that encode
# their own answers; a forwarded answer is bytes too).
Local: TypeAlias = Callable[[Req, Context], Awaitable[Any]]

_CREATE = "/fila.v1.FilaAdmin/CreateQueue"
_DELETE = "/fila.v1.FilaAdmin/DeleteQueue"
_LIST = "/fila.v1.FilaAdmin/ListQueues"

# How long ListQueues waits for another node's own queues before listing them as the
# placements in etcd say (names and owners, no numbers).
LIST_TIMEOUT_S = 5.0


class ClusterQueues:
    def __init__(
        self,
        *,
        router: Router,
        peers: Peers,
        placements: Placements,
        nodes: Nodes,
        lease: NodeLease,
        broker: Broker,
        replication: Replication,
    ) -> None:
        self._router = router
        self._replication = replication
        self._node_id = router.node_id
        self._peers = peers
        self._placements = placements
        self._nodes = nodes
        self._lease = lease
        self._broker = broker

    async def forward(
        self, node: NodeRecord, method: str, request: Any, context: Context, queue: str
    ) -> bytes:
        """`request` answered by `node`, as bytes; OwnerDown if it does not answer."""
        return await self._peers.unary(
            node,
            method,
            request.SerializeToString(),
            context,
            lambda: OwnerDown(queue, node.node_id),
        )

    # -- create ------------------------------------------------------------------------------

    async def create(
        self,
        request: admin_pb2.CreateQueueRequest,
        context: Context,
        local: Local[admin_pb2.CreateQueueRequest],
    ) -> Any:
        """Places the queue on the live node owning the fewest (SPEC 9), which claims
        the name in etcd and creates it; a node that died within its lease TTL is
        passed over for the next."""
        down: set[int] = set()
        while not is_forwarded(context):
            owner = self._place(request.name, down)
            if owner is None:
                break
            try:
                created = await self.forward(owner, _CREATE, request, context, request.name)
                self._router.unknown.forget(request.name)
                return created
            except OwnerDown:
                # Chosen while etcd still counts it live: the queue does not exist, so
                # place it elsewhere.
                down.add(owner.node_id)
        return await self._create_here(request, context, local)

    def _place(self, name: str, down: set[int]) -> NodeRecord | None:
        """The node to create `name` on (None: this one), SPEC 9's placement rule among
        the live nodes not found `down`."""
        validate_queue_name(name)
        if dlq_owner(name) is not None:
            return None  # refused with its single-node reason by the local handler
        if self._placements.owner(name) is not None:
            raise QueueAlreadyExists(name)
        live = {node.node_id: node for node in self._nodes.live() if node.node_id not in down}
        if self._lease.serving:  # (even before this node's own join reached its mirror)
            live.setdefault(self._node_id, NodeRecord(self._node_id, "", 0))
        else:  # a fenced node cannot create: leave it to a live one
            live.pop(self._node_id, None)
        if not live:
            raise self._lease.fenced_error()
        chosen = self._placements.choose(live)
        return None if chosen == self._node_id else live[chosen]

    async def _create_here(
        self,
        request: admin_pb2.CreateQueueRequest,
        context: Context,
        local: Local[admin_pb2.CreateQueueRequest],
    ) -> Any:
        name = request.name
        if not self._lease.serving:
            raise self._lease.fenced_error()
        config = request.config
        self._broker.check_create(
            name,
            config.on_enqueue_script,
            config.on_failure_script,
            config.visibility_timeout_ms,
            max_attempts=config.max_attempts,
            retry_backoff=config.retry_backoff,
        )
        followers = self._followers()
        placements = self._placements
        placements.creating.add(name)
        try:
            await placements.claim(
                name, self._node_id, followers=followers, lease=self._lease.lease
            )
            self._router.unknown.forget(name)
            try:
                response = await local(request, context)
            except BaseException:
                if name not in self._broker.queues:
                    await placements.release(name)
                raise
        finally:
            placements.creating.discard(name)
        if followers:  # answered once its followers hold it too, or after the lag bound
            await self._replication.in_sync(name, self._replication.lag_ms / 1000)
        return response

    def _followers(self) -> tuple[int, ...]:
        """The followers of a queue created here now: `replication_factor` - 1 live nodes
        holding the fewest replicas; Unavailable when fewer nodes are up."""
        factor = self._replication.factor
        if factor <= 1:
            return ()
        live = [node.node_id for node in self._nodes.live()]
        followers = self._placements.choose_followers(live, self._node_id, factor - 1)
        if len(followers) < factor - 1:
            raise Unavailable(
                f"replication_factor is {factor} but {len(followers) + 1} node(s) are up: "
                "start more nodes, or lower replication_factor"
            )
        return tuple(followers)

    # -- delete ------------------------------------------------------------------------------

    async def delete(
        self,
        request: admin_pb2.DeleteQueueRequest,
        context: Context,
        local: Local[admin_pb2.DeleteQueueRequest],
    ) -> Any:
        """Deletes where the queue lives, then releases its placement in etcd."""
        name = request.queue
        target = await self._router.target(name, forwarded=is_forwarded(context))
        if target is not LOCAL:
            return await self.forward(target, _DELETE, request, context, name)
        placed_here = self._placements.owner(name) == self._node_id
        if placed_here and name not in self._broker.queues:
            if name not in self._placements.creating:  # a placement left by a crash
                await self._placements.release(name)
            raise QueueNotFound(name)
        response = await local(request, context)
        if placed_here:
            try:
                await self._placements.release(name)
            except EtcdUnavailable as exc:
                raise EtcdUnavailable(
                    f'queue "{name}" was deleted, but etcd still places it on node '
                    f"{self._node_id} ({exc}); delete it again once etcd is reachable"
                ) from None
        return response

    # -- list and status ---------------------------------------------------------------------

    async def list_all(
        self,
        request: admin_pb2.ListQueuesRequest,
        context: Context,
        local: Local[admin_pb2.ListQueuesRequest],
    ) -> admin_pb2.ListQueuesResponse:
        """This node's queues, every live node's, and those of nodes that did not answer
        as their placements say (names and owners only)."""
        response: admin_pb2.ListQueuesResponse = await local(request, context)
        for info in response.queues:
            info.leader_node_id = self._node_id
            self._replicas(info)
        response.cluster_node_count = len(self._nodes)
        if is_forwarded(context):
            return response
        listed = {info.name: info for info in response.queues}
        others = [n for n in self._nodes.live() if n.node_id != self._node_id]
        answers = await asyncio.gather(*(self._list_on(node, request, context) for node in others))
        for answer in answers:
            for info in answer:
                listed.setdefault(info.name, info)
        for name in self._placements.names():  # queues of nodes that did not answer
            owner = self._placements.owner(name)
            for shown in (name, dlq_name(name)):
                if shown not in listed and owner is not None and access.may_see(shown):
                    listed[shown] = self._replicas(
                        admin_pb2.QueueInfo(name=shown, leader_node_id=owner)
                    )
        return admin_pb2.ListQueuesResponse(
            queues=[listed[name] for name in sorted(listed)],
            cluster_node_count=len(self._nodes),
        )

    async def _list_on(
        self, node: NodeRecord, request: admin_pb2.ListQueuesRequest, context: Context
    ) -> list[admin_pb2.QueueInfo]:
        try:
            raw = await self._peers.unary(
                node,
                _LIST,
                request.SerializeToString(),
                context,
                lambda: OwnerDown("-", node.node_id),
                timeout_cap=LIST_TIMEOUT_S,  # one slow node must not hold up the listing
            )
        except BrokerError as exc:
            log.warning("node %d did not list its queues: %s", node.node_id, exc)
            return []
        return list(admin_pb2.ListQueuesResponse.FromString(raw).queues)

    def _replicas(self, info: admin_pb2.QueueInfo) -> admin_pb2.QueueInfo:
        """`info` with the queue's replicas and in-sync set from its placement."""
        placement = self._placements.get(info.name)
        if placement is None:
            return info
        replicas, in_sync = replica_sets(placement)
        del info.replica_node_ids[:]
        del info.in_sync_node_ids[:]
        info.replica_node_ids.extend(replicas)
        info.in_sync_node_ids.extend(in_sync)
        info.replication_count = len(in_sync)
        return info

    def stats(self, response: admin_pb2.GetStatsResponse, queue: str) -> None:
        """GetStats answered here: this node leads the queue; its replicas and ISR."""
        response.leader_node_id = self._node_id
        placement = self._placements.get(queue)
        if placement is None:
            response.replication_count = 1
            return
        replicas, in_sync = replica_sets(placement)
        response.replica_node_ids.extend(replicas)
        response.in_sync_node_ids.extend(in_sync)
        response.replication_count = len(in_sync)

    def status(self) -> admin_pb2.ClusterStatusResponse:
        """The nodes this node knows (live ones, and down ones that still own queues)."""
        counts = self._placements.counts()
        following: dict[int, int] = {}
        in_sync: dict[int, int] = {}
        for name in self._placements.names():
            placement = self._placements.get(name)
            if placement is None:
                continue
            for node_id in placement.replicas:
                if node_id != placement.node_id:
                    following[node_id] = following.get(node_id, 0) + 1
                    if node_id in placement.isr:
                        in_sync[node_id] = in_sync.get(node_id, 0) + 1
        live = {node.node_id: node for node in self._nodes.live()}
        statuses = [
            admin_pb2.ClusterNodeStatus(
                node_id=node_id,
                advertise_addr=(
                    live[node_id].advertise_addr
                    if node_id in live
                    else self._nodes.last_addr(node_id)
                ),
                up=node_id in live,
                queue_count=counts.get(node_id, 0),
                follower_count=following.get(node_id, 0),
                in_sync_count=in_sync.get(node_id, 0),
            )
            for node_id in sorted(live.keys() | counts.keys() | following.keys())
        ]
        return admin_pb2.ClusterStatusResponse(enabled=True, node_id=self._node_id, nodes=statuses)

    async def remove_node(
        self, request: admin_pb2.RemoveNodeRequest
    ) -> admin_pb2.RemoveNodeResponse:
        removal = await self._replication.remove_node(request.node_id, request.discard_lost_queues)
        return admin_pb2.RemoveNodeResponse(moved=removal.moved, discarded=removal.discarded)


def replica_sets(placement: Placement) -> tuple[list[int], list[int]]:
    """A queue's replicas (leader first) and in-sync set (leader first); an
    unreplicated queue is its owner alone."""
    leader = placement.node_id
    if not placement.replicated:
        return [leader], [leader]
    replicas = [leader, *sorted(n for n in placement.replicas if n != leader)]
    in_sync = [n for n in replicas if n in placement.isr]
    return replicas, in_sync
