"""Redis 7 as a job queue, driven by `redis` (redis-py's asyncio client).

Jobs use the reliable-queue pattern job libraries build on Redis: `LPUSH` enqueues,
`BLMOVE` atomically moves the oldest job to the worker's own processing list (so a
crashed worker's jobs are not lost), and `LREM` from that list is the ack. Each
session is one connection (`single_connection_client`). Persistence is the AOF only
(`save ""` turns RDB snapshots off): durable `appendfsync always`, which fsyncs the
AOF before replies leave, grouping all clients served in one event-loop turn;
buffered `appendfsync no`, which leaves flushing to the kernel.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from functools import cache
from itertools import count
from typing import ClassVar

import redis.asyncio as aioredis

from competitive.adapters.base import (
    Batcher,
    BrokerAdapter,
    Delivery,
    Session,
    raise_if_cancelled,
)
from competitive.model import Mode
from competitive.procs import LaunchSpec

_BLOCK_S = 1  # BLMOVE timeout; a worker simply blocks again
PIPELINE = 100  # commands per pipelined round trip in the batched rows
_FSYNC = {"durable": "always", "buffered": "no"}
_WORKER_IDS = count(1)  # each session or batcher gets a processing list of its own


def _as_bytes(value: bytes | str) -> bytes:
    """Replies are bytes (no decode_responses); the stubs also allow str."""
    return value if isinstance(value, bytes) else value.encode()


def _processing(queue: str, worker: int) -> str:
    return f"{queue}:processing:{worker}"


class _RedisSession:
    def __init__(self, client: aioredis.Redis, queue: str, worker: int) -> None:
        self._client = client
        self._queue = queue
        self._processing = _processing(queue, worker)

    async def enqueue(self, body: bytes) -> None:
        await self._client.lpush(self._queue, body)

    async def reserve(self) -> Delivery:
        while True:
            body = await self._client.blmove(
                self._queue, self._processing, _BLOCK_S, "RIGHT", "LEFT"
            )
            if body is not None:
                return Delivery(_as_bytes(body), None)
            raise_if_cancelled()

    async def ack(self, delivery: Delivery) -> None:
        removed = await self._client.lrem(self._processing, 1, delivery.body)  # type: ignore[arg-type]
        if removed != 1:
            raise RuntimeError(f"LREM removed {removed} jobs from {self._processing}")

    async def close(self) -> None:
        await self._client.aclose()


class _RedisBatcher:
    """Pipelining: PIPELINE commands per round trip, without MULTI/EXEC."""

    def __init__(self, client: aioredis.Redis, queue: str, worker: int) -> None:
        self._client = client
        self._queue = queue
        self._processing = _processing(queue, worker)

    async def enqueue_all(self, bodies: Sequence[bytes], confirmed: Callable[[int], None]) -> None:
        for start in range(0, len(bodies), PIPELINE):
            chunk = bodies[start : start + PIPELINE]
            pipe = self._client.pipeline(transaction=False)
            for body in chunk:
                pipe.lpush(self._queue, body)
            await pipe.execute()  # raises on the first failed command
            for i in range(start, start + len(chunk)):
                confirmed(i)

    async def drain(self, count: int, delivered: Callable[[bytes], None]) -> None:
        done = 0
        while done < count:
            pipe = self._client.pipeline(transaction=False)
            for _ in range(min(PIPELINE, count - done)):
                pipe.lmove(self._queue, self._processing, "RIGHT", "LEFT")
            moved = [_as_bytes(b) for b in await pipe.execute() if b is not None]
            if not moved:
                # Empty while jobs are still owed: wait for one instead of spinning.
                body = await self._client.blmove(
                    self._queue, self._processing, _BLOCK_S, "RIGHT", "LEFT"
                )
                moved = [_as_bytes(body)] if body is not None else []
                raise_if_cancelled()
            acks = self._client.pipeline(transaction=False)
            for body in moved:
                acks.lrem(self._processing, 1, body)  # type: ignore[arg-type]
            removed = await acks.execute()
            if any(n != 1 for n in removed):
                raise RuntimeError(f"LREM removed {removed} from {self._processing}")
            for body in moved:
                delivered(body)
            done += len(moved)

    async def close(self) -> None:
        await self._client.aclose()


class Redis(BrokerAdapter):
    name: ClassVar[str] = "redis"
    title: ClassVar[str] = "Redis"
    client_library: ClassVar[str] = "redis (redis-py asyncio)"

    @classmethod
    def missing(cls) -> str | None:
        return None if shutil.which("redis-server") else "redis-server is not installed"

    @classmethod
    @cache
    def version(cls) -> str:
        out = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=True
        ).stdout
        return next((p[2:] for p in out.split() if p.startswith("v=")), out.strip())

    @classmethod
    def settings(cls, mode: Mode) -> str:
        return f"AOF on, appendfsync {_FSYNC[mode]}, RDB snapshots off; reliable-queue pattern"

    @classmethod
    def batching(cls) -> str:
        return f"pipelining, {PIPELINE} commands per round trip (LPUSH; LMOVE then LREM)"

    def launch_spec(self) -> LaunchSpec:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        argv = [
            "redis-server",
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(data),
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", _FSYNC[self.mode],
            "--protected-mode", "no",
            "--logfile", "",
        ]  # fmt: skip
        return LaunchSpec(argv, self.workdir)

    def _client(self) -> aioredis.Redis:
        return aioredis.Redis(
            host="127.0.0.1",
            port=self.port,
            single_connection_client=True,
            socket_connect_timeout=2,
        )

    async def probe(self) -> bool:
        client = self._client()
        try:
            return bool(await client.ping())
        except aioredis.ConnectionError:
            return False
        finally:
            await client.aclose()

    async def create_queue(self, queue: str) -> None:
        pass  # lists exist while they hold jobs

    async def delete_queue(self, queue: str) -> None:
        client = self._client()
        try:
            keys = [k async for k in client.scan_iter(match=f"{queue}:processing:*")]
            await client.delete(queue, *keys)
        finally:
            await client.aclose()

    async def open_session(self, queue: str) -> Session:
        return _RedisSession(self._client(), queue, next(_WORKER_IDS))

    async def open_batcher(self, queue: str) -> Batcher:
        return _RedisBatcher(self._client(), queue, next(_WORKER_IDS))

    async def remaining(self, queue: str) -> int:
        client = self._client()
        try:
            total = int(await client.llen(queue))
            async for key in client.scan_iter(match=f"{queue}:processing:*"):
                total += int(await client.llen(key))
            return total
        finally:
            await client.aclose()
