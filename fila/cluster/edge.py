"""Cluster routing at the gRPC edge: one server interceptor that applies `ROUTES`.

It sits after authentication (so the caller is bound and unary ACL rules are
checked, as on a single node) and in front of the ordinary handlers, which stay
exactly as they are: a call this node serves goes to them unchanged; a call it does
not serve is forwarded, split, redirected or merged, by the rule its method has in
`fila.cluster.routing.ROUTES`, and the decision for each queue is made in one place,
`Router.target`. The interceptor routes; typed modules decide what a call means for
the cluster: `ClusterQueues` (create, delete, list, status), `BatchSplitter`,
`StreamSplitter`, `FreshReads`, `SharedConfig`. A request that did not decode
(`BadRequest`) goes to the local handler, which refuses it as a single node does.

Forwarded answers pass through as bytes: the wrapped handlers accept either a
message or the owner's serialized answer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar, cast

import grpc
import grpc.aio
from google.protobuf.message import Message

from fila.cluster.batches import BatchRequest, BatchSplitter
from fila.cluster.errors import Redirect
from fila.cluster.etcd import EtcdUnavailable
from fila.cluster.fresh import FreshReads, FreshRequest
from fila.cluster.layout import Layout
from fila.cluster.lease import NodeLease
from fila.cluster.mirror import Mirror
from fila.cluster.nodes import Nodes
from fila.cluster.peers import Peers, is_forwarded
from fila.cluster.placement import Placements
from fila.cluster.queue_admin import ClusterQueues
from fila.cluster.replication.service import Replication
from fila.cluster.routing import LOCAL, ROUTES, Reads, Route, Router, Rule
from fila.cluster.shared import SharedConfig
from fila.cluster.streams import StreamSplitter
from fila.core.broker import Broker
from fila.core.errors import BrokerError
from fila.server import access
from fila.server.access import Kind
from fila.server.handlers import Handler, behaviour_of, rebuild
from fila.server.readers import StreamReaders
from fila.server.rpc import BadRequest
from fila.server.status import abort
from fila.v1 import admin_pb2, service_pb2

log = logging.getLogger("fila.cluster")

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Behaviour = Callable[..., Awaitable[Any]]
Req = TypeVar("Req")
# A typed decision: the decoded request, the call's context, the local handler.
Decide: TypeAlias = Callable[[Req, Context, Behaviour], Awaitable[Any]]


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
        replication: Replication,
        readers: StreamReaders | None = None,
    ) -> None:
        self._router = router
        self._node_id = router.node_id
        self._peers = peers
        self._config = config
        self._readers = readers
        self._max_batch = broker.settings.max_batch_messages
        self._queues = ClusterQueues(
            router=router,
            peers=peers,
            placements=placements,
            nodes=nodes,
            lease=lease,
            broker=broker,
            replication=replication,
        )
        self._batches = BatchSplitter(router, peers, self._max_batch)
        self._fresh_reads = FreshReads(layout, mirror)
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
            return _decided(inner, self._batch(method, rule.field))
        if route is Route.STREAM_ITEMS:
            return self._stream_enqueue(inner)
        if route is Route.REDIRECT:
            if handler.request_streaming:
                return self._stream_consume(inner)
            return self._consume(inner)
        if route is Route.EVERY_NODE:
            return _decided(inner, self._queues.list_all)
        if route is Route.PLACE:
            return _decided(inner, self._queues.create)
        if route is Route.DELETE:
            return _decided(inner, self._queues.delete)
        if route is Route.CONFIG_WRITE:
            return _decided(inner, self._set_config)
        if route is Route.FRESH:
            assert rule.reads is not None
            return _decided(inner, self._fresh(rule.reads))
        if route is Route.CLUSTER:
            return _decided(inner, self._cluster_status)
        if route is Route.REMOVE_NODE:
            return _decided(inner, self._remove_node)
        return inner  # Route.LOCAL

    # -- one queue -----------------------------------------------------------------------

    def _queue_call(self, method: str, field: str, inner: Behaviour) -> Behaviour:
        async def decide(request: Message, context: Context, local: Behaviour) -> Any:
            queue: str = getattr(request, field)
            target = await self._router.target(queue, forwarded=is_forwarded(context))
            if target is not LOCAL:
                return await self._queues.forward(target, method, request, context, queue)
            response = await local(request, context)
            if isinstance(response, admin_pb2.GetStatsResponse):
                self._queues.stats(response, queue)
            return response

        return _decided(inner, decide)

    def _batch(self, method: str, field: str) -> Decide[BatchRequest]:
        async def decide(request: BatchRequest, context: Context, local: Behaviour) -> Any:
            return await self._batches.call(method, field, request, context, local)

        return decide

    def _stream_enqueue(self, inner: Behaviour) -> Behaviour:
        async def call(
            requests: AsyncIterator[service_pb2.StreamEnqueueRequest | BadRequest],
            context: Context,
        ) -> None:
            splitter = StreamSplitter(
                self._router, self._peers, inner, context, self._max_batch, self._readers
            )
            try:
                await splitter.run(requests)
            except BrokerError as exc:
                await abort(context, exc)

        return call

    # -- consume: served by the owner only -------------------------------------------------

    def _consume(self, inner: Behaviour) -> Behaviour:
        async def call(request: service_pb2.ConsumeRequest | BadRequest, context: Context) -> None:
            if not isinstance(request, BadRequest):
                await self._redirect_unless_here(request.queue, context)
            await inner(request, context)

        return call

    def _stream_consume(self, inner: Behaviour) -> Behaviour:
        async def call(
            requests: AsyncIterator[service_pb2.StreamConsumeRequest | BadRequest],
            context: Context,
        ) -> None:
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

    # -- shared state ------------------------------------------------------------------------

    async def _set_config(
        self, request: admin_pb2.SetConfigRequest, context: Context, local: Behaviour
    ) -> admin_pb2.SetConfigResponse:
        await self._config.set(request.key, request.value)
        return admin_pb2.SetConfigResponse()

    def _fresh(self, reads: Reads) -> Decide[FreshRequest]:
        async def decide(request: FreshRequest, context: Context, local: Behaviour) -> Any:
            try:
                await self._fresh_reads.refresh(reads, request)
            except EtcdUnavailable as exc:
                log.warning("answering from this node's copy, etcd is away: %s", exc)
            return await local(request, context)

        return decide

    async def _cluster_status(
        self, request: admin_pb2.ClusterStatusRequest, context: Context, local: Behaviour
    ) -> admin_pb2.ClusterStatusResponse:
        return self._queues.status()

    async def _remove_node(
        self, request: admin_pb2.RemoveNodeRequest, context: Context, local: Behaviour
    ) -> admin_pb2.RemoveNodeResponse:
        return await self._queues.remove_node(request)


# -- plumbing ----------------------------------------------------------------------------------


def _decided(inner: Behaviour, decide: Decide[Any]) -> Behaviour:
    """A unary behaviour that hands a decoded request to `decide` (with `inner`, the
    local handler) and maps its BrokerError to the call's status; a request that did
    not decode goes to `inner`, which refuses it as a single node does."""

    async def call(request: object, context: Context) -> Any:
        if isinstance(request, BadRequest):
            return await inner(request, context)
        try:
            return await decide(request, context, inner)
        except BrokerError as exc:
            await abort(context, exc)

    return call


async def _empty() -> AsyncIterator[Any]:
    return
    yield  # an async generator that yields nothing


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _serialize(response: bytes | Message) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()
