"""`latency_floor_*`: the light-load latency of this gRPC stack and this disk when the
server does the least a durable broker must.

The light-load target (p50 at most 1 ms, enqueue send to delivery) is an absolute
figure on a host whose speed moves by a third from one minute to the next. The echo
ceiling answers the same question for throughput; this is its counterpart for
latency: a bare `grpc.aio` server in its own process, pinned like the broker, that
speaks just enough `fila.v1` for the latency case's client (the SDK's `AsyncClient`,
unchanged) and does only what no durable broker can skip:

- `StreamEnqueue`: appends each request to one file and answers once an `fdatasync`
  of it has completed; the synced messages then go to the waiting `Consume` stream,
  after the answer, in the broker's order;
- `AckBatch`: appends and syncs, then answers;
- `CreateQueue`: answers.

Syncs run on one thread, one at a time, and whatever is appended meanwhile waits for
the next (group commit, as `fila.storage.committer` does). No scheduling, leases,
index or ids beyond a counter: what is left is gRPC's calls and frames, the event
loop, the hand-offs between threads and processes, and the disk. The latency case
measures it just before the broker, with the same client and schedule, and reports
the broker's p50 as a ratio to it.

Run as `python -m fila_bench.floor PORT DIRECTORY`; it exits when its stdin closes,
so it cannot outlive the benchmark that started it, and prints how many syncs it did
(`{"syncs": N}`), which the case checks against the messages it answered.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import queue
import shutil
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from fila.v1 import admin_pb2, messages_pb2, service_pb2
from fila_bench.load import CheckFailed
from fila_bench.sidecar import sidecar, until_stdin_closes


class SyncedLog:
    """One append-only file; `append` calls back on the loop once the bytes are synced."""

    def __init__(self, path: Path, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._loop = loop
        self._waiting: list[Callable[[], None]] = []  # appended, not yet in a sync
        self._syncing = False
        self._requests: queue.SimpleQueue[list[Callable[[], None]] | None] = queue.SimpleQueue()
        self.syncs = 0
        self._thread = threading.Thread(target=self._sync_loop, name="floor-fsync", daemon=True)
        self._thread.start()

    def append(self, data: bytes, synced: Callable[[], None]) -> None:
        os.write(self._fd, data)
        self._waiting.append(synced)
        if not self._syncing:
            self._start_sync()

    def _start_sync(self) -> None:
        self._syncing = True
        covered, self._waiting = self._waiting, []
        self._requests.put(covered)

    def close(self) -> None:
        """Ends the sync thread once the syncs asked for have run, and closes the file."""
        self._requests.put(None)
        self._thread.join()
        os.close(self._fd)

    def _sync_loop(self) -> None:
        while (covered := self._requests.get()) is not None:
            os.fdatasync(self._fd)
            self._loop.call_soon_threadsafe(self._sync_done, covered)

    def _sync_done(self, covered: list[Callable[[], None]]) -> None:
        self.syncs += 1
        self._syncing = False
        for synced in covered:
            synced()
        if self._waiting:
            self._start_sync()


class FloorService:
    """The four RPCs the latency case's client calls, each as thin as durability allows."""

    def __init__(self, log: SyncedLog) -> None:
        self._log = log
        self._ready: asyncio.Queue[messages_pb2.Message] = asyncio.Queue()
        self._ids = itertools.count(1)

    async def stream_enqueue(
        self, requests: AsyncIterator[service_pb2.StreamEnqueueRequest], context: Any
    ) -> None:
        loop = asyncio.get_running_loop()
        async for request in requests:
            ids = [f"{next(self._ids):032x}" for _ in request.messages]
            synced: asyncio.Future[None] = loop.create_future()
            self._log.append(
                request.SerializeToString(), functools.partial(synced.set_result, None)
            )
            await synced
            answer = service_pb2.StreamEnqueueResponse(
                sequence_number=request.sequence_number,
                results=[service_pb2.EnqueueResult(message_id=i) for i in ids],
            )
            for message_id, message in zip(ids, request.messages, strict=True):
                self._ready.put_nowait(
                    messages_pb2.Message(
                        id=message_id, headers=message.headers, payload=message.payload
                    )
                )
            await context.write(answer)

    async def consume(self, request: service_pb2.ConsumeRequest, context: Any) -> None:
        while True:
            message = await self._ready.get()
            await context.write(service_pb2.ConsumeResponse(message=message))

    async def ack_batch(
        self, request: service_pb2.AckBatchRequest, context: Any
    ) -> service_pb2.AckBatchResponse:
        synced: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._log.append(request.SerializeToString(), functools.partial(synced.set_result, None))
        await synced
        return service_pb2.AckBatchResponse(results=[service_pb2.BatchError()] * len(request.acks))

    async def create_queue(
        self, request: admin_pb2.CreateQueueRequest, context: Any
    ) -> admin_pb2.CreateQueueResponse:
        return admin_pb2.CreateQueueResponse(queue_id=request.name)

    def handlers(self) -> tuple[grpc.GenericRpcHandler[Any, Any], ...]:
        s, a = service_pb2, admin_pb2
        service = {
            "StreamEnqueue": grpc.stream_stream_rpc_method_handler(
                self.stream_enqueue,
                request_deserializer=s.StreamEnqueueRequest.FromString,
                response_serializer=s.StreamEnqueueResponse.SerializeToString,
            ),
            "Consume": grpc.unary_stream_rpc_method_handler(
                self.consume,
                request_deserializer=s.ConsumeRequest.FromString,
                response_serializer=s.ConsumeResponse.SerializeToString,
            ),
            "AckBatch": grpc.unary_unary_rpc_method_handler(
                self.ack_batch,
                request_deserializer=s.AckBatchRequest.FromString,
                response_serializer=s.AckBatchResponse.SerializeToString,
            ),
        }
        admin = {
            "CreateQueue": grpc.unary_unary_rpc_method_handler(
                self.create_queue,
                request_deserializer=a.CreateQueueRequest.FromString,
                response_serializer=a.CreateQueueResponse.SerializeToString,
            )
        }
        return (
            grpc.method_handlers_generic_handler("fila.v1.FilaService", service),
            grpc.method_handlers_generic_handler("fila.v1.FilaAdmin", admin),
        )


async def serve(port: int, directory: Path) -> int:
    """Serves until stdin closes; returns how many syncs the log did."""
    loop = asyncio.get_running_loop()
    log = SyncedLog(directory / "log", loop)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(FloorService(log).handlers())
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await until_stdin_closes()
    await server.stop(1)  # a grace period: calls end with GOAWAY NO_ERROR, not logged
    log.close()
    return log.syncs


@dataclass
class Floor:
    addr: str
    syncs: int | None = None  # known once the server has exited

    def check_synced(self, answered: int) -> None:
        """With one enqueue in flight, each is appended after the previous one's sync
        and answered after its own: fewer syncs than answers means a floor that did
        less than a durable broker must, and a latency that flatters it."""
        if self.syncs is None or self.syncs < answered:
            raise CheckFailed(f"latency floor: {self.syncs} syncs for {answered} answered enqueues")


@asynccontextmanager
async def latency_floor(workdir: Path, server_cpus: frozenset[int] | None) -> AsyncIterator[Floor]:
    """Starts the floor server (pinned like a broker, its file under `workdir`); on
    exit stops it and records its sync count in the yielded `Floor`."""
    directory = Path(tempfile.mkdtemp(prefix="latency-floor-", dir=workdir))
    try:
        async with sidecar("fila_bench.floor", [str(directory)], server_cpus) as server:
            floor = Floor(server.addr)
            yield floor
        if server.output:
            floor.syncs = int(json.loads(server.output)["syncs"])
    finally:
        await asyncio.to_thread(shutil.rmtree, directory, True)


def main() -> None:
    syncs = asyncio.run(serve(int(sys.argv[1]), Path(sys.argv[2])))
    print(json.dumps({"syncs": syncs}), flush=True)


if __name__ == "__main__":
    main()
