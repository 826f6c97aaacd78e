"""Fila itself, started with its own `fila-server` and driven through `fila_sdk`.

One `AsyncClient` per session. The one-in-flight rows enqueue with the plain
`enqueue` (which rides a `StreamEnqueue` stream) and consume through a `Worker` with
one slot and a prefetch of 1, so a stream holds one unacknowledged job at a time, as
a worker with one job in flight does on every other broker (RabbitMQ prefetch 1, a
NATS fetch of 1, one BLMOVE, one beanstalkd reserve); `scheduler.consumer_buffer` is
1 as well, for any plain `Consume` stream.

gRPC pools subchannels per process, so `AsyncClient`s created with the same options
share one TCP connection. When the SDK accepts `channel_options`, each session asks
for a local subchannel pool and gets a connection of its own; until then the runner
counts the TCP connections it really sees and says so in the rows' note.

The batched rows are written against the SDK fast paths of SPEC section 7
(`enqueue_many`, `consume(queue, prefetch=, max_batch=)`, `ack_many`). An SDK without
them makes `open_batcher` raise `BatchingUnavailable`, and the rows say "not
available" instead of carrying a number.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar, Final

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

import fila_sdk
from competitive.adapters.base import Batcher, BatchingUnavailable, BrokerAdapter, Delivery, Session
from competitive.model import Mode
from competitive.procs import LaunchSpec

_PERSIST: Final = {"durable": "sync", "buffered": "buffer"}
_BATCH_CALLS: Final = ("enqueue_many", "ack_many")
ENQUEUE_CHUNK: Final = 100  # messages per enqueue_many call in the batched rows
PREFETCH: Final = 1_000  # unacked messages the batched consumer's stream may hold
MAX_BATCH: Final = 100  # messages per delivery frame in the batched rows
ACK_CHUNK: Final = 100  # ids per ack_many call


def _consume_accepts_batching() -> bool:
    params = inspect.signature(fila_sdk.AsyncClient.consume).parameters
    return "prefetch" in params and "max_batch" in params


def batch_api_missing() -> str | None:
    """What the installed SDK lacks of SPEC 7's fast paths, or None when it has them."""
    absent = [n for n in _BATCH_CALLS if not hasattr(fila_sdk.AsyncClient, n)]
    if not _consume_accepts_batching():
        absent.append("consume(prefetch=, max_batch=)")
    if not absent:
        return None
    return "the installed fila_sdk has no " + ", ".join(absent) + " (SPEC 7 batch paths)"


def _channel_options_supported() -> bool:
    return "channel_options" in inspect.signature(fila_sdk.AsyncClient).parameters


def new_client(addr: str) -> fila_sdk.AsyncClient:
    """An SDK client on a TCP connection of its own where the SDK allows it."""
    if _channel_options_supported():
        options: Any = (("grpc.use_local_subchannel_pool", 1),)
        return fila_sdk.AsyncClient(addr, channel_options=options)  # type: ignore[call-arg,unused-ignore]
    return fila_sdk.AsyncClient(addr)


class _FilaSession:
    """Enqueue through `AsyncClient.enqueue` (a frame on its `StreamEnqueue` stream);
    reserve and ack through a `fila_sdk.Worker` with one slot and a prefetch of 1,
    the SDK's way to consume: the handler hands each message to `reserve` and
    returns when `ack` is called, and the worker acks it on its `StreamConsume`
    stream. Like RabbitMQ's `basic.ack` (prefetch 1) that ack has no reply; the
    empty-queue check after each cell shows every one of them took effect."""

    def __init__(self, client: fila_sdk.AsyncClient, queue: str) -> None:
        self._client = client
        self._queue = queue
        self._worker: fila_sdk.AsyncWorker | None = None
        self._reserved: asyncio.Queue[tuple[fila_sdk.Message, asyncio.Event]] = asyncio.Queue()
        self._held: dict[str, asyncio.Event] = {}

    async def enqueue(self, body: bytes) -> None:
        await self._client.enqueue(self._queue, None, body)

    async def _handle(self, message: fila_sdk.Message) -> None:
        acked = asyncio.Event()
        self._reserved.put_nowait((message, acked))
        await acked.wait()

    async def reserve(self) -> Delivery:
        if self._worker is None:
            self._worker = fila_sdk.AsyncWorker(
                self._client, self._queue, self._handle, concurrency=1, prefetch=1, grace_period=0
            )
            await self._worker.__aenter__()
        message, acked = await self._reserved.get()
        self._held[message.id] = acked
        return Delivery(message.payload, message.id)

    async def ack(self, delivery: Delivery) -> None:
        self._held.pop(str(delivery.handle)).set()
        await asyncio.sleep(0)  # let the handler return and the worker write the ack

    async def close(self) -> None:
        if self._worker is not None:
            # Unreserved messages the handler still holds are released by the stop.
            await self._worker.__aexit__(None, None, None)
        await self._client.close()


def _failed(result: object) -> str | None:
    """The error in one per-item result of a batch call, or None if it succeeded."""
    if result is None or isinstance(result, str):
        return None
    if isinstance(result, BaseException):
        return f"{type(result).__name__}: {result}"
    error = getattr(result, "error", None)
    return None if error is None else str(error)


class _FilaBatcher:
    """SDK batching: enqueue_many chunks, a prefetching batched stream, ack_many."""

    def __init__(self, client: fila_sdk.AsyncClient, queue: str) -> None:
        self._client = client
        self._queue = queue
        self._item_shape: Callable[[bytes], object] | None = None

    async def _enqueue_many(self, chunk: Sequence[bytes]) -> list[object]:
        call: Any = self._client.enqueue_many  # type: ignore[attr-defined,unused-ignore]
        if self._item_shape is None:
            # SPEC 7 names the call, not the item type: try (headers, payload) pairs,
            # then bare payloads, once, and keep what the SDK accepts.
            for shape in (lambda b: (None, b), lambda b: b):
                try:
                    results = list(await call(self._queue, [shape(b) for b in chunk]))
                except TypeError:
                    continue
                self._item_shape = shape
                return results
            raise BatchingUnavailable("enqueue_many accepted neither (headers, payload) nor bytes")
        return list(await call(self._queue, [self._item_shape(b) for b in chunk]))

    async def enqueue_all(self, bodies: Sequence[bytes], confirmed: Callable[[int], None]) -> None:
        for start in range(0, len(bodies), ENQUEUE_CHUNK):
            chunk = bodies[start : start + ENQUEUE_CHUNK]
            results = await self._enqueue_many(chunk)
            if len(results) != len(chunk):
                raise RuntimeError(f"enqueue_many answered {len(results)} of {len(chunk)}")
            for offset, result in enumerate(results):
                if (error := _failed(result)) is not None:
                    raise RuntimeError(f"enqueue_many item {start + offset}: {error}")
                confirmed(start + offset)

    async def _ack(self, ids: list[str]) -> None:
        call: Any = self._client.ack_many  # type: ignore[attr-defined,unused-ignore]
        results = await call(self._queue, ids)
        errors = [e for r in (results or ()) if (e := _failed(r)) is not None]
        if errors:
            raise RuntimeError(f"ack_many: {len(errors)} failed, e.g. {errors[0]}")

    async def drain(self, count: int, delivered: Callable[[bytes], None]) -> None:
        consume: Any = self._client.consume
        stream = consume(self._queue, prefetch=PREFETCH, max_batch=MAX_BATCH)
        pending: list[tuple[str, bytes]] = []
        done = 0
        try:
            async for item in stream:
                for message in item if isinstance(item, list | tuple) else (item,):
                    pending.append((message.id, message.payload))
                if len(pending) >= ACK_CHUNK or done + len(pending) >= count:
                    await self._ack([i for i, _ in pending])
                    for _, body in pending:
                        delivered(body)
                    done += len(pending)
                    pending.clear()
                if done >= count:
                    return
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def close(self) -> None:
        await self._client.close()


class Fila(BrokerAdapter):
    name: ClassVar[str] = "fila"
    title: ClassVar[str] = "Fila"
    client_library: ClassVar[str] = "fila_sdk (AsyncClient)"
    start_timeout_s: ClassVar[float] = 30.0

    def __init__(self, mode: Mode, workdir: Path, *, cpu: int | None, instance: str) -> None:
        super().__init__(mode, workdir, cpu=cpu, instance=instance)
        self._admin: fila_sdk.AsyncClient | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def missing(cls) -> str | None:
        return None  # this repository

    @classmethod
    def version(cls) -> str:
        try:
            return metadata.version("fila")
        except metadata.PackageNotFoundError:
            return "unknown"

    @classmethod
    def settings(cls, mode: Mode) -> str:
        persist = _PERSIST[mode]
        what = "fsync (group commit) before answering" if mode == "durable" else "no fsync"
        return f'persist_mode = "{persist}" ({what}); scheduler.consumer_buffer = 1'

    @classmethod
    def batching(cls) -> str:
        if (reason := batch_api_missing()) is not None:
            return f"not available: {reason}"
        return (
            f"enqueue_many ({ENQUEUE_CHUNK} per call), consume(prefetch={PREFETCH}, "
            f"max_batch={MAX_BATCH}), ack_many ({ACK_CHUNK} per call)"
        )

    def launch_spec(self) -> LaunchSpec:
        config = self.workdir / "fila.toml"
        config.write_text(
            f'[storage]\npersist_mode = "{_PERSIST[self.mode]}"\n\n'
            "[scheduler]\nconsumer_buffer = 1\n",
            encoding="utf-8",
        )
        script = Path(sys.executable).with_name("fila-server")
        argv = [str(script)] if script.exists() else [sys.executable, "-m", "fila.server.main"]
        env = {
            "FILA_DATA_DIR": str(self.workdir / "data"),
            "FILA_LISTEN_ADDR": self.addr,
            "PYTHONUNBUFFERED": "1",
        }
        return LaunchSpec(
            [*argv, "--config", str(config)], self.workdir, env, drop_env_prefixes=("FILA_",)
        )

    async def probe(self) -> bool:
        async with grpc.aio.insecure_channel(self.addr) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0
                )
            except grpc.aio.AioRpcError:
                return False
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def start(self) -> float:
        took = await super().start()
        self._admin = fila_sdk.AsyncClient(self.addr)
        return took

    async def stop(self) -> None:
        if self._admin is not None:
            with contextlib.suppress(Exception):
                await self._admin.close()
            self._admin = None
        await super().stop()

    def _admin_client(self) -> fila_sdk.AsyncClient:
        if self._admin is None:
            raise RuntimeError("fila-server is not running")
        return self._admin

    async def create_queue(self, queue: str) -> None:
        await self._admin_client().create_queue(queue)

    async def delete_queue(self, queue: str) -> None:
        await self._admin_client().delete_queue(queue)

    async def open_session(self, queue: str) -> Session:
        return _FilaSession(new_client(self.addr), queue)

    async def open_batcher(self, queue: str) -> Batcher:
        if (reason := batch_api_missing()) is not None:
            raise BatchingUnavailable(reason)
        return _FilaBatcher(new_client(self.addr), queue)

    async def remaining(self, queue: str) -> int:
        stats = await self._admin_client().get_stats(queue)
        return int(stats.depth) + int(stats.in_flight)
