"""A stand-in `fila.v1.FilaService` on `grpc.aio` for the SDK tests.

It serves only the methods a test gives it (everything else answers UNIMPLEMENTED,
as an older broker would) and records every request with its metadata and the
client's address, so a test can count what actually went over the wire: how many
requests, on how many connections, with which headers. It runs on an event loop
of its own thread, so sync and async clients can both talk to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from fila.v1 import service_pb2

SERVICE = "fila.v1.FilaService"


@dataclass
class Recorded:
    method: str
    request: Any
    metadata: dict[str, str]
    peer: str


@dataclass
class FakeBroker:
    addr: str = ""
    calls: list[Recorded] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(
        self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        metadata = {k: str(v) for k, v in (context.invocation_metadata() or ())}
        with self.lock:
            self.calls.append(Recorded(method, request, metadata, context.peer()))

    def of(self, method: str) -> list[Recorded]:
        with self.lock:
            return [c for c in self.calls if c.method == method]


Unary = Callable[[Any, FakeBroker], Awaitable[Any]]


def unary(method: str, request_cls: Any, respond: Unary, broker: FakeBroker) -> Any:
    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        broker.record(method, request, context)
        return await respond(request, broker)

    return grpc.unary_unary_rpc_method_handler(
        handle,
        request_deserializer=request_cls.FromString,
        response_serializer=lambda m: m.SerializeToString(),
    )


def silent_stream(method: str, request_cls: Any, broker: FakeBroker) -> Any:
    """A bidi stream that records its requests and never answers (for deadlines)."""

    async def handle(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async for request in requests:
            broker.record(method, request, context)
        if False:  # an async generator that yields nothing
            yield None

    return grpc.stream_stream_rpc_method_handler(
        handle,
        request_deserializer=request_cls.FromString,
        response_serializer=lambda m: m.SerializeToString(),
    )


@dataclass
class ScriptedConsume:
    """A StreamConsume stand-in: delivers `messages` in one frame after the opening
    request, records every later request, and whether the client ended the stream
    by half-closing it (the clean way) or by cancelling it."""

    messages: list[Any]
    requests: list[Any] = field(default_factory=list)
    half_closed: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def handler(self, broker: FakeBroker) -> Any:
        async def handle(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            try:
                iterator = aiter(requests)
                self.requests.append(await anext(iterator))
                yield service_pb2.ConsumeResponse(messages=self.messages)
                async for request in iterator:
                    broker.record("StreamConsume", request, context)
                    self.requests.append(request)
                await asyncio.sleep(0.1)  # a cancellation that ended the reading lands here
                if context.cancelled():
                    self.cancelled.set()
                else:
                    self.half_closed.set()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

        return grpc.stream_stream_rpc_method_handler(
            handle,
            request_deserializer=service_pb2.StreamConsumeRequest.FromString,
            response_serializer=lambda m: m.SerializeToString(),
        )


async def numbered_ids(request: service_pb2.EnqueueRequest, broker: FakeBroker) -> Any:
    return service_pb2.EnqueueResponse(message_id=f"u{len(broker.of('Enqueue'))}")


async def batch_ids(request: service_pb2.EnqueueBatchRequest, broker: FakeBroker) -> Any:
    results = [service_pb2.EnqueueResult(message_id=f"b{i}") for i in range(len(request.messages))]
    return service_pb2.EnqueueBatchResponse(results=results)


def sleeper(seconds: float, response: Any) -> Unary:
    async def respond(request: Any, broker: FakeBroker) -> Any:
        await asyncio.sleep(seconds)
        return response

    return respond


@contextmanager
def fake_broker(
    handlers: Callable[[FakeBroker], Mapping[str, Any]],
) -> Iterator[FakeBroker]:
    """Serves `handlers(broker)` (method name -> grpc handler) on 127.0.0.1."""
    broker = FakeBroker()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    server_box: list[grpc.aio.Server] = []

    async def start() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, dict(handlers(broker))),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        broker.addr = f"127.0.0.1:{port}"
        server_box.append(server)
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield broker
    finally:
        asyncio.run_coroutine_threadsafe(server_box[0].stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


__all__ = [
    "FakeBroker",
    "ScriptedConsume",
    "batch_ids",
    "fake_broker",
    "numbered_ids",
    "silent_stream",
    "sleeper",
    "unary",
]
