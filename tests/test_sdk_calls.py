"""Batch settlement against a broker without `AckBatch` / `NackBatch`: both clients
settle one unary call per item instead, and ask for a batch once only (the requests
and the fallback are written once, in fila_sdk._calls)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
from support.sdk_fakes import FakeBroker, fake_broker, unary

from fila.v1 import service_pb2
from fila_sdk import AsyncClient, Client


def _refused(method: str, request_cls: Any, broker: FakeBroker) -> Any:
    """A method the broker does not have (UNIMPLEMENTED), recorded when asked for."""

    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        broker.record(method, request, context)
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"no method {method}")

    return grpc.unary_unary_rpc_method_handler(
        handle,
        request_deserializer=request_cls.FromString,
        response_serializer=lambda m: m.SerializeToString(),
    )


async def _acked(request: Any, broker: FakeBroker) -> Any:
    return service_pb2.AckResponse()


async def _nacked(request: Any, broker: FakeBroker) -> Any:
    return service_pb2.NackResponse()


def _handlers(b: FakeBroker) -> dict[str, Any]:
    return {
        "Ack": unary("Ack", service_pb2.AckRequest, _acked, b),
        "Nack": unary("Nack", service_pb2.NackRequest, _nacked, b),
        "AckBatch": _refused("AckBatch", service_pb2.AckBatchRequest, b),
        "NackBatch": _refused("NackBatch", service_pb2.NackBatchRequest, b),
    }


def _settled(fake: FakeBroker) -> tuple[list[str], list[tuple[str, str]], int]:
    acks = [c.request.message_id for c in fake.of("Ack")]
    nacks = [(c.request.message_id, c.request.error) for c in fake.of("Nack")]
    batches = len(fake.of("AckBatch")) + len(fake.of("NackBatch"))
    return acks, nacks, batches


def test_the_blocking_client_settles_one_by_one_without_batch_rpcs() -> None:
    with fake_broker(_handlers) as fake, Client(fake.addr) as client:
        assert client.ack_many("q", ["a", "b"]) == [None, None]
        assert client.nack_many("q", ["c", ("d", "own")], error="shared") == [None, None]
        assert client.ack_many("q", ["e"]) == [None]
        assert _settled(fake) == (["a", "b", "e"], [("c", "shared"), ("d", "own")], 1)


def test_the_async_client_settles_one_by_one_without_batch_rpcs() -> None:
    async def scenario(addr: str) -> None:
        async with AsyncClient(addr) as client:
            await asyncio.gather(client.ack("q", "a"), client.ack("q", "b"))
            assert await client.nack_many("q", [("c", "own")]) == [None]
            await client.nack("q", "d", "why")
            assert await client.ack_many("q", ["e"]) == [None]

    with fake_broker(_handlers) as fake:
        asyncio.run(scenario(fake.addr))
        acks, nacks, batches = _settled(fake)
        assert (sorted(acks), nacks, batches) == (["a", "b", "e"], [("c", "own"), ("d", "why")], 1)
