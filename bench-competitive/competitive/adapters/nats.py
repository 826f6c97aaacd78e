"""NATS JetStream as a job queue, driven by `nats-py`.

Each queue is a file-storage stream with work-queue retention (a message is removed
once acked) and one durable pull consumer with explicit acks that every worker binds
to. Publishing waits for the PubAck (the message is stored); a worker fetches one
message and acks it with `ack_sync`, so the ack is a confirmed round trip like the
other brokers' acks.

Durability: nats-server 2.10 and later accept `sync_interval: always` in the
`jetstream` block (fsync on every write before the PubAck); the adapter sets it in
durable mode when the installed server accepts it. Older servers have no fsync
setting at all: JetStream hands writes to the kernel before acknowledging and fsyncs
on a fixed timer (two minutes), so durable mode there is the same configuration as
buffered, and every durable row says so in its note.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, ClassVar, Final

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from competitive.adapters.base import (
    Batcher,
    BrokerAdapter,
    Delivery,
    Session,
    raise_if_cancelled,
)
from competitive.model import Mode
from competitive.procs import LaunchSpec

CONSUMER: Final = "workers"
WINDOW: Final = 100  # async publishes in flight, and messages per fetch, when batched
_FETCH_WAIT_S: Final = 1.0
_ACK_WAIT_S: Final = 30.0
_MAX_ACK_PENDING: Final = 10_000


@cache
def _server_version() -> tuple[int, int, int]:
    out = subprocess.run(
        ["nats-server", "--version"], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(r"v?(\d+)\.(\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"cannot read the nats-server version from {out!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


def has_sync_interval() -> bool:
    """`sync_interval` (with `always`) exists in the jetstream block from 2.10 on."""
    return _server_version() >= (2, 10, 0)


async def _quiet(_: Exception) -> None:
    """Readiness probes expect refused connections; nats-py would log each one."""


async def _connect(port: int, *, probing: bool = False) -> NatsClient:
    options: dict[str, Any] = {"error_cb": _quiet} if probing else {}
    return await nats.connect(
        f"nats://127.0.0.1:{port}",
        connect_timeout=2,
        allow_reconnect=False,
        max_reconnect_attempts=0,
        **options,
    )


class _NatsSession:
    def __init__(self, nc: NatsClient, queue: str) -> None:
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self._queue = queue
        self._sub: JetStreamContext.PullSubscription | None = None

    async def enqueue(self, body: bytes) -> None:
        await self._js.publish(self._queue, body)

    async def reserve(self) -> Delivery:
        if self._sub is None:
            self._sub = await self._js.pull_subscribe_bind(CONSUMER, stream=self._queue)
        while True:
            try:
                msgs = await self._sub.fetch(1, timeout=_FETCH_WAIT_S)
            except nats.errors.TimeoutError:
                raise_if_cancelled()
                continue
            if msgs:
                return Delivery(msgs[0].data, msgs[0])

    async def ack(self, delivery: Delivery) -> None:
        msg = delivery.handle
        assert isinstance(msg, Msg)
        await msg.ack_sync(timeout=5.0)

    async def close(self) -> None:
        await self._nc.close()


class _NatsBatcher:
    """Asynchronous publish with a bounded window; fetch in batches, ack each."""

    def __init__(self, nc: NatsClient, queue: str) -> None:
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream(publish_async_max_pending=WINDOW)
        self._queue = queue

    async def enqueue_all(self, bodies: Sequence[bytes], confirmed: Callable[[int], None]) -> None:
        futures = [await self._js.publish_async(self._queue, body) for body in bodies]
        for i, future in enumerate(futures):
            await future  # the PubAck, or the error it failed with
            confirmed(i)

    async def drain(self, count: int, delivered: Callable[[bytes], None]) -> None:
        sub = await self._js.pull_subscribe_bind(CONSUMER, stream=self._queue)
        done = 0
        while done < count:
            try:
                msgs = await sub.fetch(min(WINDOW, count - done), timeout=_FETCH_WAIT_S)
            except nats.errors.TimeoutError:
                raise_if_cancelled()
                continue
            for msg in msgs:
                await msg.ack()  # no reply per ack; the flush below orders them all
                delivered(msg.data)
            done += len(msgs)
        await self._nc.flush(timeout=10)  # the server has every ack once PONG returns

    async def close(self) -> None:
        await self._nc.close()


class Nats(BrokerAdapter):
    name: ClassVar[str] = "nats"
    title: ClassVar[str] = "NATS JetStream"
    client_library: ClassVar[str] = "nats-py"

    @classmethod
    def missing(cls) -> str | None:
        return None if shutil.which("nats-server") else "nats-server is not installed"

    @classmethod
    def version(cls) -> str:
        return ".".join(str(p) for p in _server_version())

    @classmethod
    def settings(cls, mode: Mode) -> str:
        base = "file storage, work-queue stream, pull consumer, explicit ack"
        if mode == "durable" and has_sync_interval():
            return f"{base}, sync_interval: always (fsync every write)"
        if mode == "durable":
            return f"{base}; no sync setting in {cls.version()}: default flushing"
        return f"{base}, default flushing"

    @classmethod
    def mode_note(cls, mode: Mode) -> str:
        if mode == "durable" and not has_sync_interval():
            return (
                f"not fsync-durable: nats-server {cls.version()} has no sync_interval "
                "(2.10+), so durable = buffered settings"
            )
        return ""

    @classmethod
    def batching(cls) -> str:
        return f"publish_async, {WINDOW} in flight; fetch({WINDOW}) with an ack per message"

    def launch_spec(self) -> LaunchSpec:
        store = self.workdir / "jetstream"
        sync = "\n  sync_interval: always" if self.mode == "durable" and has_sync_interval() else ""
        config = self.workdir / "nats.conf"
        config.write_text(
            f'listen: 127.0.0.1:{self.port}\njetstream {{\n  store_dir: "{store}"{sync}\n}}\n',
            encoding="utf-8",
        )
        return LaunchSpec(["nats-server", "-c", str(config)], self.workdir)

    async def probe(self) -> bool:
        try:
            nc = await _connect(self.port, probing=True)
        except (nats.errors.NoServersError, OSError):
            return False
        try:
            await nc.jetstream().account_info()  # JetStream itself answers
            return True
        except nats.js.errors.ServiceUnavailableError:
            return False
        finally:
            await nc.close()

    async def _admin(self) -> NatsClient:
        return await _connect(self.port)

    async def create_queue(self, queue: str) -> None:
        nc = await self._admin()
        try:
            js = nc.jetstream()
            await js.add_stream(
                StreamConfig(
                    name=queue,
                    subjects=[queue],
                    storage=StorageType.FILE,
                    retention=RetentionPolicy.WORK_QUEUE,
                )
            )
            await js.add_consumer(
                queue,
                ConsumerConfig(
                    durable_name=CONSUMER,
                    ack_policy=AckPolicy.EXPLICIT,
                    ack_wait=_ACK_WAIT_S,
                    max_ack_pending=_MAX_ACK_PENDING,
                ),
            )
        finally:
            await nc.close()

    async def delete_queue(self, queue: str) -> None:
        nc = await self._admin()
        try:
            await nc.jetstream().delete_stream(queue)
        finally:
            await nc.close()

    async def open_session(self, queue: str) -> Session:
        return _NatsSession(await _connect(self.port), queue)

    async def open_batcher(self, queue: str) -> Batcher:
        return _NatsBatcher(await _connect(self.port), queue)

    async def remaining(self, queue: str) -> int:
        nc = await self._admin()
        try:
            info = await nc.jetstream().stream_info(queue)
            return int(info.state.messages)
        finally:
            await nc.close()
