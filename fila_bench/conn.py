"""Connections the load generators use: SDK clients, each on its own TCP connection.

A benchmark whose variable is the number of connections (the 50-producer enqueue,
the 1/8/50 durability matrix) needs real ones: each `AsyncClient` keeps its own
(`fila_sdk` sets `grpc.use_local_subchannel_pool`; without it gRPC pooled them
process-wide, checked with `ss`: five clients, one connection). Those rows measure
what a user of the SDK gets: `enqueue` rides an open `StreamEnqueue` stream, acks are
coalesced into `AckBatch`.

`UnaryConnection` is the other client: one unary `Enqueue` call per message over the
raw stubs. Only the echo ceiling uses it, because the ceiling is defined as what this
stack does for one-message-per-call designs (the echo server answers unary `Enqueue`
and nothing else).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

import grpc
import grpc.aio

from fila.v1 import service_pb2, service_pb2_grpc
from fila_sdk import AsyncClient, Message

# A raw channel on its own TCP connection, taking messages of any size (as fila_sdk's).
_OWN_CONNECTION = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", -1),
)


class Connection(Protocol):
    """The hot-path calls a producer or worker makes; `AsyncClient` satisfies it."""

    async def enqueue(
        self, queue: str, headers: Mapping[str, str] | None, payload: bytes
    ) -> str: ...

    def consume(self, queue: str) -> AsyncIterator[Message]: ...

    async def ack(self, queue: str, message_id: str) -> None: ...

    async def close(self) -> None: ...


class UnaryConnection:
    """One TCP connection of its own, one unary call per message (see the module docstring)."""

    def __init__(self, addr: str) -> None:
        self._channel = grpc.aio.insecure_channel(addr, options=_OWN_CONNECTION)
        self._stub = service_pb2_grpc.FilaServiceStub(self._channel)

    async def enqueue(self, queue: str, headers: Mapping[str, str] | None, payload: bytes) -> str:
        request = service_pb2.EnqueueRequest(queue=queue, headers=headers, payload=payload)
        return (await self._stub.Enqueue(request)).message_id

    async def consume(self, queue: str) -> AsyncIterator[Message]:
        call = self._stub.Consume(service_pb2.ConsumeRequest(queue=queue))
        try:
            async for response in call:
                if response.HasField("message"):  # skip keepalive frames
                    yield Message.from_proto(response.message)
        finally:
            call.cancel()

    async def ack(self, queue: str, message_id: str) -> None:
        await self._stub.Ack(service_pb2.AckRequest(queue=queue, message_id=message_id))

    async def close(self) -> None:
        await self._channel.close(None)


def open_connections(addr: str, count: int) -> list[AsyncClient]:
    """`count` SDK clients, that is `count` TCP connections."""
    return [AsyncClient(addr) for _ in range(count)]


async def close_all(connections: Sequence[Connection]) -> None:
    await asyncio.gather(*(c.close() for c in connections))
