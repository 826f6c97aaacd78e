"""Cluster routing at the gRPC edge: one server interceptor that applies `ROUTES`.

It sits after authentication (so the caller is bound and unary ACL rules are
checked, as on a single node) and in front of the ordinary handlers, which stay
exactly as they are: a call this node serves goes to them unchanged; a call it does
not serve is forwarded, split, redirected or merged here, by the rule its method has
in `fila.cluster.routing.ROUTES`, and the decision for each queue is made in one
place, `Router.target`.

Forwarded answers pass through as bytes: the wrapped handlers accept either a
message or the owner's serialized answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeAlias, cast

import grpc
import grpc.aio
from google.protobuf.message import Message

from fila.cluster.errors import OwnerDown, Redirect
from fila.cluster.etcd import EtcdUnavailable
from fila.cluster.layout import ACLS, API_KEYS, Layout, NodeRecord
from fila.cluster.lease import NodeLease
from fila.cluster.mirror import Mirror
from fila.cluster.nodes import Nodes
from fila.cluster.peers import Peers, is_forwarded
from fila.cluster.placement import Placements
from fila.cluster.routing import LOCAL, ROUTES, Reads, Route, Router, Rule
from fila.cluster.shared import SharedConfig
from fila.cluster.streams import StreamSplitter
from fila.core.broker import Broker
from fila.core.errors import BrokerError, QueueAlreadyExists, QueueNotFound
from fila.core.queue import validate_queue_name
from fila.server import access
from fila.server.access import Kind
from fila.server.handlers import Handler, behaviour_of, rebuild
from fila.server.readers import StreamReaders
from fila.server.rpc import BadRequest
from fila.server.status import abort, batch_error
from fila.v1 import admin_pb2, service_pb2
from fila.wire import dlq_name, dlq_owner

log = logging.getLogger("fila.cluster")

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Behaviour = Callable[..., Awaitable[Any]]

# How long ListQueues waits for another node's own queues before listing them as the
# placements in etcd say (names and owners, no numbers).
LIST_TIMEOUT_S = 5.0

# Batch answers: the response type, and how one item's error is wrapped in it.
_BATCHES: dict[str, tuple[type[Message], Callable[[service_pb2.BatchError], Message]]] = {
    "EnqueueBatch": (
        service_pb2.EnqueueBatchResponse,
        lambda error: service_pb2.EnqueueResult(error=error),
    ),
    "AckBatch": (service_pb2.AckBatchResponse, lambda error: error),
    "NackBatch": (service_pb2.NackBatchResponse, lambda error: error),
}


class _Unreachable(BrokerError):
    """A node did not answer a forwarded batch; each item becomes an OwnerDown."""

    def __init__(self, node_id: int) -> None:
        super().__init__(f"node {node_id} is down")
        self.node_id = node_id


class Edge(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(
        self,
        *,
        router: Router,
        peers: Peers,
        placements: Placements,
        nodes: Nodes,
        lease: NodeLease,
        config: SharedConfig,
        mirror: Mirror,
        layout: Layout,
        broker: Broker,
        readers: StreamReaders | None = None,
    ) -> None:
        self._router = router
        self._node_id = router.node_id
        self._peers = peers
        self._placements = placements
        self._nodes = nodes
        self._lease = lease
        self._config = config
        self._mirror = mirror
        self._layout = layout
        self._broker = broker
        self._readers = readers
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        rule = ROUTES.get(method)
        if handler is None or rule is None:
            return handler  # health, reflection, unknown methods
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = (handler, rebuild(handler, self._behaviour(method, rule, handler), _serialize))
            self._wrapped[method] = cached
        return cached[1]

    def _behaviour(self, method: str, rule: Rule, handler: Handler) -> Behaviour:
        inner = cast(Behaviour, behaviour_of(handler))
        route = rule.route
        if route is Route.QUEUE:
            return self._queue_call(method, rule.field, inner)
        if route is Route.ITEMS:
            return self._batch_call(method, rule.field, inner)
        if route is Route.STREAM_ITEMS:
            return self._stream_enqueue(inner)
        if route is Route.REDIRECT:
            if handler.request_streaming:
                return self._stream_consume(inner)
            return self._consume(inner)
        if route is Route.EVERY_NODE:
            return self._list_queues(method, inner)
        if route is Route.PLACE:
            return self._create_queue(method, inner)
        if route is Route.DELETE:
            return self._delete_queue(method, inner)
        if route is Route.CONFIG_WRITE:
            return self._set_config
        if route is Route.FRESH:
            assert rule.reads is not None
            return self._fresh(rule.reads, inner)
        if route is Route.CLUSTER:
            return self._cluster_status
        return inner  # Route.LOCAL

    # -- one queue -----------------------------------------------------------------------

    def _queue_call(self, method: str, field: str, inner: Behaviour) -> Behaviour:
        async def call(request: Any, context: Context) -> Any:
            if isinstance(request, BadRequest):
                return await inner(request, context)
            queue = getattr(request, field)
            try:
                target = await self._router.target(queue, forwarded=is_forwarded(context))
                if target is LOCAL:
                    response = await inner(request, context)
                    if isinstance(response, admin_pb2.GetStatsResponse):
                        response.leader_node_id = self._node_id
                    return response
                return await self._forward(target, method, request, context, queue)
            except BrokerError as exc:
                await abort(context, exc)

        return call

    async def _forward(
        self, node: NodeRecord, method: str, request: Message, context: Context, queue: str
    ) -> bytes:
        return await self._peers.unary(
            node,
            method,
            request.SerializeToString(),
            context,
            lambda: OwnerDown(queue, node.node_id),
        )

    # -- batches -------------------------------------------------------------------------

    def _batch_call(self, method: str, field: str, inner: Behaviour) -> Behaviour:
        response_type, wrap = _BATCHES[method.rpartition("/")[2]]
        max_batch = self._broker.settings.max_batch_messages
        kind = access.rule_for(method).kind
        assert kind is not None  # a batch's rule is EACH_ITEM with its kind

        async def call(request: Any, context: Context) -> Any:
            if isinstance(request, BadRequest):
                return await inner(request, context)
            items = getattr(request, field)
            if not 0 < len(items) <= max_batch:
                return await inner(request, context)  # refused whole, as on one node
            forwarded = is_forwarded(context)
            targets: dict[str, Any] = {}
            for item in items:
                if item.queue not in targets:
                    targets[item.queue] = await self._item_target(kind, item.queue, forwarded)
            if all(t is LOCAL for t in targets.values()):
                return await inner(request, context)
            results: list[Message | None] = [None] * len(items)
            groups: dict[Any, list[int]] = {}
            for index, item in enumerate(items):
                target = targets[item.queue]
                if isinstance(target, BrokerError):
                    results[index] = wrap(batch_error(target))
                else:
                    groups.setdefault(target, []).append(index)

            def part(indexes: list[int]) -> Any:
                sub = type(request)()
                getattr(sub, field).extend(items[i] for i in indexes)
                return sub

            async def local(indexes: list[int]) -> None:
                response = await inner(part(indexes), context)
                if isinstance(response, bytes):  # answers the handler encoded itself
                    response = response_type.FromString(response)
                for index, result in zip(indexes, response.results, strict=False):
                    results[index] = result

            async def remote(node: NodeRecord, indexes: list[int]) -> None:
                try:
                    raw = await self._peers.unary(
                        node,
                        method,
                        part(indexes).SerializeToString(),
                        context,
                        lambda: _Unreachable(node.node_id),
                    )
                except _Unreachable:
                    for index in indexes:
                        error = OwnerDown(items[index].queue, node.node_id)
                        results[index] = wrap(batch_error(error))
                    return
                except BrokerError as exc:
                    for index in indexes:
                        results[index] = wrap(batch_error(exc))
                    return
                answered = response_type.FromString(raw).results  # type: ignore[attr-defined]
                for index, result in zip(indexes, answered, strict=False):
                    results[index] = result

            remotes = [remote(t, ix) for t, ix in groups.items() if t is not LOCAL]
            await _together(local(groups[LOCAL]) if LOCAL in groups else None, remotes)
            return response_type(results=results)  # type: ignore[call-arg]

        return call

    async def _item_target(self, kind: Kind, queue: str, forwarded: bool) -> Any:
        """Where a batch item on `queue` goes, or the error it gets: PERMISSION_DENIED
        before anything else, so that an item the caller may not touch never makes
        this node ask etcd where its queue lives (the owner would refuse it too)."""
        if not access.permits(kind, queue):
            return access.denied(kind, queue)
        try:
            return await self._router.target(queue, forwarded=forwarded)
        except BrokerError as exc:
            return exc

    def _stream_enqueue(self, inner: Behaviour) -> Behaviour:
        max_batch = self._broker.settings.max_batch_messages

        async def call(requests: AsyncIterator[Any], context: Context) -> None:
            splitter = StreamSplitter(
                self._router, self._peers, inner, context, max_batch, self._readers
            )
            try:
                await splitter.run(requests)
            except BrokerError as exc:
                await abort(context, exc)

        return call

    # -- consume: served by the owner only -------------------------------------------------

    def _consume(self, inner: Behaviour) -> Behaviour:
        async def call(request: Any, context: Context) -> None:
            if not isinstance(request, BadRequest):
                await self._redirect_unless_here(request.queue, context)
            await inner(request, context)

        return call

    def _stream_consume(self, inner: Behaviour) -> Behaviour:
        async def call(requests: AsyncIterator[Any], context: Context) -> None:
            iterator = aiter(requests)
            try:
                first = await anext(iterator)
            except StopAsyncIteration:
                await inner(_empty(), context)
                return
            if not isinstance(first, BadRequest):
                try:  # refused before its queue is looked up, as the handler would
                    access.require_key()
                    access.require(Kind.CONSUME, first.queue)
                except BrokerError as exc:
                    await abort(context, exc)
                await self._redirect_unless_here(first.queue, context)
            await inner(_chain(first, iterator), context)

        return call

    async def _redirect_unless_here(self, queue: str, context: Context) -> None:
        try:
            target = await self._router.target(queue, forwarded=is_forwarded(context))
        except BrokerError as exc:
            await abort(context, exc)
        if target is not LOCAL:
            await abort(context, Redirect(queue, target.node_id, target.advertise_addr))

    # -- queue lifecycle ---------------------------------------------------------------------

    def _create_queue(self, method: str, inner: Behaviour) -> Behaviour:
        async def call(request: Any, context: Context) -> Any:
            if isinstance(request, BadRequest):
                return await inner(request, context)
            try:
                down: set[int] = set()
                while not is_forwarded(context):
                    owner = self._place(request.name, down)
                    if owner is None:
                        break
                    try:
                        created = await self._forward(owner, method, request, context, request.name)
                        self._router.unknown.forget(request.name)
                        return created
                    except OwnerDown:
                        # Chosen while etcd still counts it live (it died within its
                        # lease TTL): the queue does not exist, so place it elsewhere.
                        down.add(owner.node_id)
                return await self._create_here(request, context, inner)
            except BrokerError as exc:
                await abort(context, exc)

        return call

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

    async def _create_here(self, request: Any, context: Context, inner: Behaviour) -> Any:
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
        placements = self._placements
        placements.creating.add(name)
        try:
            await placements.claim(name, self._node_id)
            self._router.unknown.forget(name)
            try:
                return await inner(request, context)
            except BaseException:
                if name not in self._broker.queues:
                    await placements.release(name)
                raise
        finally:
            placements.creating.discard(name)

    def _delete_queue(self, method: str, inner: Behaviour) -> Behaviour:
        async def call(request: Any, context: Context) -> Any:
            if isinstance(request, BadRequest):
                return await inner(request, context)
            name = request.queue
            try:
                target = await self._router.target(name, forwarded=is_forwarded(context))
                if target is not LOCAL:
                    return await self._forward(target, method, request, context, name)
                placed_here = self._placements.owner(name) == self._node_id
                if placed_here and name not in self._broker.queues:
                    if name not in self._placements.creating:  # a placement left by a crash
                        await self._placements.release(name)
                    raise QueueNotFound(name)
                response = await inner(request, context)
                if placed_here:
                    try:
                        await self._placements.release(name)
                    except EtcdUnavailable as exc:
                        raise EtcdUnavailable(
                            f'queue "{name}" was deleted, but etcd still places it on node '
                            f"{self._node_id} ({exc}); delete it again once etcd is reachable"
                        ) from None
                return response
            except BrokerError as exc:
                await abort(context, exc)

        return call

    def _list_queues(self, method: str, inner: Behaviour) -> Behaviour:
        async def call(request: Any, context: Context) -> Any:
            if isinstance(request, BadRequest):
                return await inner(request, context)
            response = await inner(request, context)
            for info in response.queues:
                info.leader_node_id = self._node_id
            response.cluster_node_count = len(self._nodes)
            if is_forwarded(context):
                return response
            listed = {info.name: info for info in response.queues}
            others = [n for n in self._nodes.live() if n.node_id != self._node_id]
            answers = await asyncio.gather(
                *(self._list_on(node, method, request, context) for node in others)
            )
            for answer in answers:
                for info in answer:
                    listed.setdefault(info.name, info)
            for name in self._placements.names():  # queues of nodes that did not answer
                owner = self._placements.owner(name)
                for shown in (name, dlq_name(name)):
                    if shown not in listed and owner is not None and access.may_see(shown):
                        listed[shown] = admin_pb2.QueueInfo(name=shown, leader_node_id=owner)
            return admin_pb2.ListQueuesResponse(
                queues=[listed[name] for name in sorted(listed)],
                cluster_node_count=len(self._nodes),
            )

        return call

    async def _list_on(
        self, node: NodeRecord, method: str, request: Any, context: Context
    ) -> list[admin_pb2.QueueInfo]:
        try:
            raw = await self._peers.unary(
                node,
                method,
                request.SerializeToString(),
                context,
                lambda: OwnerDown("-", node.node_id),
                timeout_cap=LIST_TIMEOUT_S,  # one slow node must not hold up the listing
            )
        except BrokerError as exc:
            log.warning("node %d did not list its queues: %s", node.node_id, exc)
            return []
        return list(admin_pb2.ListQueuesResponse.FromString(raw).queues)

    # -- shared state ------------------------------------------------------------------------

    async def _set_config(self, request: Any, context: Context) -> Any:
        if isinstance(request, BadRequest):
            await abort(context, request.error())
        try:
            await self._config.set(request.key, request.value)
        except BrokerError as exc:
            await abort(context, exc)
        return admin_pb2.SetConfigResponse()

    def _fresh(self, reads: Reads, inner: Behaviour) -> Behaviour:
        async def call(request: Any, context: Context) -> Any:
            if not isinstance(request, BadRequest):
                try:
                    await self._refresh(reads, request)
                except EtcdUnavailable as exc:
                    log.warning("answering from this node's copy, etcd is away: %s", exc)
            return await inner(request, context)

        return call

    async def _refresh(self, reads: Reads, request: Any) -> None:
        layout, mirror = self._layout, self._mirror
        if reads is Reads.CONFIG_KEY:
            if 0 < len(request.key) <= 1024:
                await mirror.refresh(layout.config(request.key))
        elif reads is Reads.CONFIG:
            if len(request.prefix) <= 1024:
                await mirror.refresh_prefix(layout.config(request.prefix))
        elif reads is Reads.KEY_ID:
            # Read only for a caller the Keyring might answer (whoever may not manage
            # keys is refused from this node's copy, without making etcd read).
            if 0 < len(request.key_id) <= 255 and access.may_manage_keys(request.key_id):
                await mirror.refresh(layout.acl(request.key_id))
                await mirror.refresh(layout.api_key(request.key_id))
        elif access.may_manage_keys():
            await mirror.refresh_prefix(layout.section(ACLS))
            await mirror.refresh_prefix(layout.section(API_KEYS))

    async def _cluster_status(self, request: Any, context: Context) -> Any:
        if isinstance(request, BadRequest):
            await abort(context, request.error())
        counts = self._placements.counts()
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
            )
            for node_id in sorted(live.keys() | counts.keys())
        ]
        return admin_pb2.ClusterStatusResponse(enabled=True, node_id=self._node_id, nodes=statuses)


# -- plumbing ----------------------------------------------------------------------------------


async def _together(local: Awaitable[None] | None, remotes: Sequence[Awaitable[None]]) -> None:
    """Runs the remote parts as tasks and the local part here; if the local part fails
    (the call is aborted) the remote parts are cancelled before the failure goes on."""
    tasks = [asyncio.ensure_future(r) for r in remotes]
    try:
        if local is not None:
            await local
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _empty() -> AsyncIterator[Any]:
    return
    yield  # an async generator that yields nothing


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _serialize(response: bytes | Message) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()
