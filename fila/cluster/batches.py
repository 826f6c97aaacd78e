"""A batch call (EnqueueBatch, AckBatch, NackBatch) split by owner and merged back.

Each item names its own queue. Items this node serves go to the local handler in one
part; each other owner's items go to it in one forwarded part; the answers are put
back in request order. An item's refusal (no permission, unknown queue, its owner
down) is its own result, never the call's: as on a single node. Permission is checked
before anything else, so an item the caller may not touch never makes this node ask
etcd where its queue lives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias

import grpc.aio
from google.protobuf.message import Message

from fila.cluster.errors import OwnerDown
from fila.cluster.layout import NodeRecord
from fila.cluster.peers import Peers, is_forwarded
from fila.cluster.routing import LOCAL, Router
from fila.core.errors import BrokerError
from fila.server import access
from fila.server.access import Kind
from fila.server.status import batch_error
from fila.v1 import service_pb2

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
BatchRequest: TypeAlias = (
    service_pb2.EnqueueBatchRequest | service_pb2.AckBatchRequest | service_pb2.NackBatchRequest
)
Local: TypeAlias = Callable[[BatchRequest, Context], Awaitable[Any]]
Target: TypeAlias = "NodeRecord | object | BrokerError"


def _enqueue_result(error: service_pb2.BatchError) -> Message:
    return service_pb2.EnqueueResult(error=error)


def _as_is(error: service_pb2.BatchError) -> Message:
    return error


# Per method: the response type, and how one item's error is wrapped in its results.
_SHAPES: dict[str, tuple[type[Message], Callable[[service_pb2.BatchError], Message]]] = {
    "EnqueueBatch": (service_pb2.EnqueueBatchResponse, _enqueue_result),
    "AckBatch": (service_pb2.AckBatchResponse, _as_is),
    "NackBatch": (service_pb2.NackBatchResponse, _as_is),
}


class _Unreachable(BrokerError):
    """A node did not answer a forwarded batch; each item becomes an OwnerDown."""

    def __init__(self, node_id: int) -> None:
        super().__init__(f"node {node_id} is down")
        self.node_id = node_id


class BatchSplitter:
    def __init__(self, router: Router, peers: Peers, max_batch: int) -> None:
        self._router = router
        self._peers = peers
        self._max_batch = max_batch

    async def call(
        self, method: str, field: str, request: BatchRequest, context: Context, local: Local
    ) -> Any:
        response_type, wrap = _SHAPES[method.rpartition("/")[2]]
        kind = access.rule_for(method).kind
        assert kind is not None  # a batch's rule is EACH_ITEM with its kind
        items: Sequence[Any] = getattr(request, field)
        if not 0 < len(items) <= self._max_batch:
            return await local(request, context)  # refused whole, as on one node
        forwarded = is_forwarded(context)
        targets: dict[str, Target] = {}
        for item in items:
            if item.queue not in targets:
                targets[item.queue] = await self._target(kind, item.queue, forwarded)
        if all(t is LOCAL for t in targets.values()):
            return await local(request, context)
        results: list[Message | None] = [None] * len(items)
        groups: dict[Any, list[int]] = {}
        for index, item in enumerate(items):
            target = targets[item.queue]
            if isinstance(target, BrokerError):
                results[index] = wrap(batch_error(target))
            else:
                groups.setdefault(target, []).append(index)

        def part(indexes: list[int]) -> BatchRequest:
            sub = type(request)()
            getattr(sub, field).extend(items[i] for i in indexes)
            return sub

        async def here(indexes: list[int]) -> None:
            response = await local(part(indexes), context)
            if isinstance(response, bytes):  # answers the handler encoded itself
                response = response_type.FromString(response)
            for index, result in zip(indexes, response.results, strict=False):
                results[index] = result

        async def there(node: NodeRecord, indexes: list[int]) -> None:
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

        remotes = [there(t, ix) for t, ix in groups.items() if t is not LOCAL]
        await together(here(groups[LOCAL]) if LOCAL in groups else None, remotes)
        return response_type(results=results)  # type: ignore[call-arg]

    async def _target(self, kind: Kind, queue: str, forwarded: bool) -> Target:
        """Where an item on `queue` goes, or the error it gets: PERMISSION_DENIED before
        anything else (the owner would refuse it too)."""
        if not access.permits(kind, queue):
            return access.denied(kind, queue)
        try:
            return await self._router.target(queue, forwarded=forwarded)
        except BrokerError as exc:
            return exc


async def together(local: Awaitable[None] | None, remotes: Sequence[Awaitable[None]]) -> None:
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
