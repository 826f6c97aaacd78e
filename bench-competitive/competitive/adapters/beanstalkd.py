"""beanstalkd, driven by `greenstalk`.

greenstalk is a blocking client, so each session owns one thread (a single-worker
executor) that makes all of that connection's calls in order; the event loop only
waits on it. One job in flight per connection is exactly what a blocking client
does anyway. `put` returns once the job is stored (after the binlog write and, with
`-f 0`, its fsync), `reserve-with-timeout` reserves one job, `delete` is the ack.

Durable mode writes the binlog with `-f 0` (fsync after every write); buffered mode
uses `-f 86400000` (fsync at most once a day, so in practice the kernel decides).
`-z` raises the job size limit to 1 MiB because the default (65,535 bytes) is one
byte short of the 64 KiB payload row. beanstalkd has no batch commands: its batched
rows are reported as not available.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import ClassVar, Final, TypeVar

import greenstalk

from competitive.adapters.base import (
    Batcher,
    BatchingUnavailable,
    BrokerAdapter,
    Delivery,
    Session,
    raise_if_cancelled,
)
from competitive.model import Mode
from competitive.procs import LaunchSpec

_FSYNC_MS: Final = {"durable": "0", "buffered": "86400000"}
_MAX_JOB_BYTES: Final = 1 << 20
_RESERVE_WAIT_S: Final = 1
_T = TypeVar("_T")


class _BeanstalkSession:
    def __init__(self, port: int, tube: str) -> None:
        self._port = port
        self._tube = tube
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="beanstalk")
        self._client: greenstalk.Client[bytes] | None = None

    async def _call(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def open(self) -> None:
        def connect() -> greenstalk.Client[bytes]:
            return greenstalk.Client(
                ("127.0.0.1", self._port), encoding=None, use=self._tube, watch=self._tube
            )

        self._client = await self._call(connect)

    def _c(self) -> greenstalk.Client[bytes]:
        if self._client is None:
            raise RuntimeError("session not open")
        return self._client

    async def enqueue(self, body: bytes) -> None:
        client = self._c()
        await self._call(lambda: client.put(body))

    async def reserve(self) -> Delivery:
        client = self._c()

        def reserve() -> greenstalk.Job[bytes] | None:
            try:
                return client.reserve(timeout=_RESERVE_WAIT_S)
            except greenstalk.TimedOutError:
                return None

        while True:
            job = await self._call(reserve)
            if job is not None:
                body = job.body
                assert isinstance(body, bytes)
                return Delivery(body, job)
            raise_if_cancelled()

    async def ack(self, delivery: Delivery) -> None:
        client = self._c()
        job = delivery.handle
        assert isinstance(job, greenstalk.Job)
        await self._call(lambda: client.delete(job))

    async def close(self) -> None:
        client = self._client
        if client is not None:
            await self._call(client.close)
        # A reserve cancelled by the harness may still be waiting (at most
        # _RESERVE_WAIT_S); shut the thread down without blocking the loop.
        await asyncio.to_thread(self._pool.shutdown, True)


class Beanstalkd(BrokerAdapter):
    name: ClassVar[str] = "beanstalkd"
    title: ClassVar[str] = "beanstalkd"
    client_library: ClassVar[str] = "greenstalk (blocking; one thread per connection)"

    @classmethod
    def missing(cls) -> str | None:
        return None if shutil.which("beanstalkd") else "beanstalkd is not installed"

    @classmethod
    @cache
    def version(cls) -> str:
        out = subprocess.run(["beanstalkd", "-v"], capture_output=True, text=True, check=False)
        return (out.stdout or out.stderr).strip().split()[-1]

    @classmethod
    def settings(cls, mode: Mode) -> str:
        return f"binlog, -f {_FSYNC_MS[mode]}"

    @classmethod
    def batching(cls) -> str:
        return "not available: the beanstalkd protocol has no batch commands"

    def launch_spec(self) -> LaunchSpec:
        binlog = self.workdir / "binlog"
        binlog.mkdir(parents=True, exist_ok=True)
        argv = [
            "beanstalkd",
            "-l", "127.0.0.1",
            "-p", str(self.port),
            "-b", str(binlog),
            "-f", _FSYNC_MS[self.mode],
            "-z", str(_MAX_JOB_BYTES),
        ]  # fmt: skip
        return LaunchSpec(argv, self.workdir)

    async def probe(self) -> bool:
        def stats() -> bool:
            with greenstalk.Client(("127.0.0.1", self.port)) as client:
                return "version" in client.stats()

        return await asyncio.wait_for(asyncio.to_thread(stats), timeout=2.0)

    async def create_queue(self, queue: str) -> None:
        pass  # tubes exist while they are used or hold jobs

    async def delete_queue(self, queue: str) -> None:
        pass

    async def open_session(self, queue: str) -> Session:
        session = _BeanstalkSession(self.port, queue)
        await session.open()
        return session

    async def open_batcher(self, queue: str) -> Batcher:
        raise BatchingUnavailable("the beanstalkd protocol has no batch commands")

    async def remaining(self, queue: str) -> int:
        def count() -> int:
            with greenstalk.Client(("127.0.0.1", self.port)) as client:
                try:
                    stats = client.stats_tube(queue)
                except greenstalk.NotFoundError:
                    return 0  # a tube with no jobs and no watchers disappears
                return sum(
                    int(stats[k])
                    for k in (
                        "current-jobs-ready",
                        "current-jobs-reserved",
                        "current-jobs-delayed",
                        "current-jobs-buried",
                    )
                )

        return await asyncio.to_thread(count)
