"""Connections the load generators use: the SDK client, or a dedicated TCP connection.

Everything goes through `fila_sdk.AsyncClient` except one case the SDK cannot express
yet. gRPC pools subchannels process-wide, so every `AsyncClient` to the same address
shares one TCP connection (checked with `ss`: five clients, one connection). A
benchmark whose variable is the number of connections (the 50-producer enqueue, the
1/8/50 durability matrix) needs real ones, and that takes a channel option
(`grpc.use_local_subchannel_pool`) the SDK does not accept. `DedicatedConnection` is
that fallback over the raw `fila.v1` stubs, with the same three calls and the same
`fila_sdk.types.Message` records, so per-call work matches the SDK's. When the SDK
grows a channel-options argument, `open_connections` is the one place to change.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import grpc
import grpc.aio

from fila.v1 import service_pb2, service_pb2_grpc
from fila_sdk import AsyncClient, Message

_DEDICATED_OPTIONS = (
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


class DedicatedConnection:
    """One TCP connection of its own, over the raw stubs (see the module docstring)."""

    def __init__(self, addr: str) -> None:
        self._channel = grpc.aio.insecure_channel(addr, options=_DEDICATED_OPTIONS)
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


def open_connections(addr: str, count: int, *, dedicated: bool) -> list[Connection]:
    """`count` connections: separate TCP connections if `dedicated`, else SDK clients."""
    if dedicated:
        return [DedicatedConnection(addr) for _ in range(count)]
    return [AsyncClient(addr) for _ in range(count)]


async def close_all(connections: list[Connection]) -> None:
    await asyncio.gather(*(c.close() for c in connections))
