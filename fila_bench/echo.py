"""`echo_ceiling_50c`: what this gRPC stack does on this host when the broker does nothing.

A bare `grpc.aio` server in its own process answers `fila.v1.FilaService/Enqueue`
with a canned reply (it parses the request, as any server must, and stores nothing).
The load generator drives it with the same load loop, 50 dedicated connections and
one 256-byte message in flight per connection, as the durable and buffered
one-in-flight rows, but one unary call per message (`UnaryConnection`): the ceiling of
one-message-per-call designs, which the SDK's stream path is meant to beat. A broker
figure divided by it says how the broker compares with what the stack allows per
call, a number that moves much less with the host than msg/s does.

The runner keeps one echo server and its 50 connections for the whole run and
measures a short window before the first throughput case and after every one, so the
ceiling is sampled across the run, when the broker's figures were taken, and not in
some other run on some other host.

The same server also answers `StreamEnqueue`, each request at once with a canned id
per message: the stream ceiling (`stream_ceiling`), what the SDK's `enqueue` (which
rides that stream) gets from this stack when the broker does nothing. The cases of
few connections compare the broker with it at the same connection count and payload
(`fila_bench.benchmarks.durability`, `fila_bench.benchmarks.competitive`).

Run as `python -m fila_bench.echo PORT`; it exits when its stdin closes, so it
cannot outlive the benchmark that started it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import grpc.aio

from fila.v1 import service_pb2
from fila_bench.conn import Connection, UnaryConnection, close_all, open_connections
from fila_bench.load import enqueue_for
from fila_bench.sidecar import sidecar, until_stdin_closes

ECHO_CASE = "echo_ceiling_50c"
SERVICE = "fila.v1.FilaService"
CONNECTIONS = 50
PAYLOAD_256B = b"j" * 256  # the payload of the durability matrix's one-in-flight rows
_CANNED = service_pb2.EnqueueResponse(message_id="00000000-0000-7000-8000-000000000000")


async def _enqueue(request: service_pb2.EnqueueRequest, context: Any) -> Any:
    return _CANNED


_CANNED_RESULT = service_pb2.EnqueueResult(message_id=_CANNED.message_id)


async def _stream_enqueue(requests: AsyncIterator[Any], context: Any) -> None:
    async for request in requests:
        await context.write(
            service_pb2.StreamEnqueueResponse(
                sequence_number=request.sequence_number,
                results=[_CANNED_RESULT] * len(request.messages),
            )
        )


async def serve(port: int) -> None:
    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(
        _enqueue,
        request_deserializer=service_pb2.EnqueueRequest.FromString,
        response_serializer=service_pb2.EnqueueResponse.SerializeToString,
    )
    stream = grpc.stream_stream_rpc_method_handler(
        _stream_enqueue,
        request_deserializer=service_pb2.StreamEnqueueRequest.FromString,
        response_serializer=service_pb2.StreamEnqueueResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Enqueue": handler, "StreamEnqueue": stream}
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await until_stdin_closes()
    await server.stop(0)


class EchoCeiling:
    """The running echo server and the load generator's 50 connections to it."""

    def __init__(self, addr: str) -> None:
        self.addr = addr
        self._conns: list[Connection] = [UnaryConnection(addr) for _ in range(CONNECTIONS)]
        self.windows: list[float] = []  # every measured rate, in run order

    async def measure(self, warmup_s: float, measure_s: float) -> float:
        """One closed-loop window over the 50 connections; returns calls per second."""
        run = await enqueue_for(
            self._conns,
            CONNECTIONS,
            "echo",
            warmup_s=warmup_s,
            measure_s=measure_s,
            payload=PAYLOAD_256B,
        )
        self.windows.append(run.rate)
        return run.rate

    async def close(self) -> None:
        await close_all(self._conns)


@asynccontextmanager
async def echo_ceiling(server_cpus: frozenset[int] | None) -> AsyncIterator[EchoCeiling]:
    """Starts the echo server (pinned like a broker) and connects to it."""
    async with sidecar("fila_bench.echo", [], server_cpus) as server:
        ceiling = EchoCeiling(server.addr)
        try:
            yield ceiling
        finally:
            await ceiling.close()


@asynccontextmanager
async def echo_server(server_cpus: frozenset[int] | None) -> AsyncIterator[str]:
    """An echo server of the case's own (pinned like a broker); yields its address."""
    async with sidecar("fila_bench.echo", [], server_cpus) as server:
        yield server.addr


async def stream_ceiling(
    addr: str, connections: int, payload: bytes, *, warmup_s: float, measure_s: float
) -> float:
    """Round trips per second of the SDK's `enqueue` (one in flight on each of
    `connections` `AsyncClient`s, each its own TCP connection) against the echo
    server at `addr`: the stream ceiling at that connection count and payload."""
    conns = open_connections(addr, connections)
    try:
        run = await enqueue_for(
            conns, connections, "echo", warmup_s=warmup_s, measure_s=measure_s, payload=payload
        )
    finally:
        await close_all(conns)
    return run.rate


def main() -> None:
    asyncio.run(serve(int(sys.argv[1])))


if __name__ == "__main__":
    main()
