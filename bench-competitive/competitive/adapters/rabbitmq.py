"""RabbitMQ as a job queue, driven by `aio-pika`.

The node runs standalone and unprivileged: its own node name, AMQP port, Erlang
distribution port and `epmd` port (so it never meets another node on this machine),
its Mnesia, log, cookie (`HOME`) and config under the temporary directory, no
plugins. `/usr/lib/rabbitmq/bin/rabbitmq-server` is called directly because the
`/usr/sbin` wrapper switches to the system `rabbitmq` user and its directories.
Readiness is the AMQP port answering a protocol header with `connection.start`
(the Erlang node answers `ping` well before the broker accepts clients). Stop is
`rabbitmqctl stop`, then SIGTERM/SIGKILL of the group and of the marked `epmd`.

Publishing uses publisher confirms on every channel, so an enqueue returns when the
broker has taken responsibility for the message; messages are persistent. A worker
consumes with prefetch 1 and acks manually. Durable mode is a quorum queue (the Raft
log is fsynced before the confirm); buffered mode is a classic durable queue, which
for persistent messages also fsyncs before the confirm (strace counted one fsync
per sequential publish): RabbitMQ has no acknowledge-before-disk setting for
persistent messages, so every buffered row says so in its note.
AMQP's `basic.ack` has no reply, so an ack costs the client one frame, not a round
trip; the batched drain ends with a synchronous call so its timer includes every ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Final

import aio_pika
import aio_pika.abc
from aio_pika import DeliveryMode, Message

from competitive.adapters.base import Batcher, BrokerAdapter, Delivery, Session
from competitive.model import Mode
from competitive.procs import LaunchSpec, free_ports

_BIN: Final = Path("/usr/lib/rabbitmq/bin")
WINDOW: Final = 100  # unconfirmed publishes in flight, and messages per multiple-ack
PREFETCH: Final = 1_000  # basic.qos of the batched consumer
_AMQP_HEADER: Final = b"AMQP\x00\x00\x09\x01"
_FRAME_METHOD: Final = 1
_STOP_TIMEOUT_S: Final = 30.0


def _tool(name: str) -> str:
    local = _BIN / name
    return str(local) if local.exists() else name


def _queue_arguments(mode: Mode) -> dict[str, Any]:
    return {"x-queue-type": "quorum"} if mode == "durable" else {}


def _message(body: bytes) -> Message:
    return Message(body, delivery_mode=DeliveryMode.PERSISTENT)


class _RabbitSession:
    def __init__(
        self,
        connection: aio_pika.abc.AbstractConnection,
        channel: aio_pika.abc.AbstractChannel,
        queue: aio_pika.abc.AbstractQueue,
    ) -> None:
        self._connection = connection
        self._channel = channel
        self._queue = queue
        self._iterator: aio_pika.abc.AbstractQueueIterator | None = None

    async def enqueue(self, body: bytes) -> None:
        # Waits for the broker's basic.ack; a nack raises DeliveryError.
        await self._channel.default_exchange.publish(_message(body), routing_key=self._queue.name)

    async def reserve(self) -> Delivery:
        if self._iterator is None:
            self._iterator = self._queue.iterator()
        message = await self._iterator.__anext__()
        return Delivery(message.body, message)

    async def ack(self, delivery: Delivery) -> None:
        message = delivery.handle
        assert isinstance(message, aio_pika.abc.AbstractIncomingMessage)
        await message.ack()

    async def close(self) -> None:
        if self._iterator is not None:
            with contextlib.suppress(Exception):
                await self._iterator.close()
        await self._connection.close()


class _RabbitBatcher:
    """A confirm window of WINDOW publishes; prefetch PREFETCH with multiple-acks."""

    def __init__(
        self,
        connection: aio_pika.abc.AbstractConnection,
        channel: aio_pika.abc.AbstractChannel,
        queue: aio_pika.abc.AbstractQueue,
    ) -> None:
        self._connection = connection
        self._channel = channel
        self._queue = queue

    async def enqueue_all(self, bodies: Sequence[bytes], confirmed: Callable[[int], None]) -> None:
        exchange = self._channel.default_exchange
        pending: set[asyncio.Task[int]] = set()

        async def publish(i: int, body: bytes) -> int:
            await exchange.publish(_message(body), routing_key=self._queue.name)
            return i

        def settle(done: set[asyncio.Task[int]]) -> None:
            for task in done:
                confirmed(task.result())  # re-raises a failed publish

        try:
            for i, body in enumerate(bodies):
                if len(pending) >= WINDOW:
                    done, pending = await asyncio.wait(pending, return_when="FIRST_COMPLETED")
                    settle(done)
                pending.add(asyncio.create_task(publish(i, body)))
            if pending:
                done, pending = await asyncio.wait(pending)
                settle(done)
        finally:
            for task in pending:
                task.cancel()

    async def drain(self, count: int, delivered: Callable[[bytes], None]) -> None:
        await self._channel.set_qos(prefetch_count=PREFETCH)
        done = 0
        unacked = 0
        async with self._queue.iterator() as iterator:
            async for message in iterator:
                delivered(message.body)
                done += 1
                unacked += 1
                if unacked >= WINDOW or done >= count:
                    await message.ack(multiple=True)
                    unacked = 0
                if done >= count:
                    break
        # basic.ack has no reply; a synchronous call on the same channel is answered
        # only after the broker has processed everything sent before it.
        await self._queue.declare()

    async def close(self) -> None:
        await self._connection.close()


class RabbitMQ(BrokerAdapter):
    name: ClassVar[str] = "rabbitmq"
    title: ClassVar[str] = "RabbitMQ"
    client_library: ClassVar[str] = "aio-pika"
    start_timeout_s: ClassVar[float] = 90.0

    def __init__(self, mode: Mode, workdir: Path, *, cpu: int | None, instance: str) -> None:
        super().__init__(mode, workdir, cpu=cpu, instance=instance)
        self._dist_port, self._epmd_port, self._ctl_port = free_ports(3)
        digest = hashlib.sha1(instance.encode()).hexdigest()[:10]
        self.node = f"bench{digest}@localhost"

    @classmethod
    def missing(cls) -> str | None:
        if (_BIN / "rabbitmq-server").exists() or shutil.which("rabbitmq-server"):
            return None
        return "rabbitmq-server is not installed"

    @classmethod
    @cache
    def version(cls) -> str:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", "rabbitmq-server"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return out.split("-")[0] or "unknown"

    @classmethod
    def settings(cls, mode: Mode) -> str:
        queue = "quorum queue" if mode == "durable" else "classic durable queue"
        return f"{queue}, persistent messages, publisher confirms, manual ack (prefetch 1)"

    @classmethod
    def mode_note(cls, mode: Mode) -> str:
        if mode == "buffered":
            return (
                "still fsyncs before each confirm (persistent messages in a classic "
                "queue; RabbitMQ has no buffered setting for persistent messages)"
            )
        return ""

    @classmethod
    def batching(cls) -> str:
        return (
            f"publisher-confirm window of {WINDOW}; consumer prefetch {PREFETCH}, "
            f"multiple-ack every {WINDOW}"
        )

    def _env(self) -> dict[str, str]:
        d = self.workdir
        return {
            "HOME": str(d),  # the Erlang cookie lives here, shared by server and CLI
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self._dist_port),
            "RABBITMQ_CTL_DIST_PORT_MIN": str(self._ctl_port),
            "RABBITMQ_CTL_DIST_PORT_MAX": str(self._ctl_port),
            "ERL_EPMD_PORT": str(self._epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(d / "mnesia"),
            "RABBITMQ_LOG_BASE": str(d / "log"),
            "RABBITMQ_CONFIG_FILE": str(d / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(d / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(d / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(d / "rabbitmq-env.conf"),  # absent on purpose
            "RABBITMQ_PID_FILE": str(d / "rabbitmq.pid"),
        }

    def launch_spec(self) -> LaunchSpec:
        d = self.workdir
        (d / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\n"
            "loopback_users = none\n"
            "log.console = false\n"
            "log.file.level = warning\n"
            "disk_free_limit.absolute = 50MB\n",
            encoding="utf-8",
        )
        (d / "advanced.config").write_text("[].\n", encoding="utf-8")
        (d / "enabled_plugins").write_text("[].\n", encoding="utf-8")
        return LaunchSpec([_tool("rabbitmq-server")], d, self._env(), ("RABBITMQ_", "ERL_"))

    async def probe(self) -> bool:
        async def handshake() -> bool:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            try:
                writer.write(_AMQP_HEADER)
                await writer.drain()
                first = await reader.read(1)
                return first == bytes([_FRAME_METHOD])
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

        return await asyncio.wait_for(handshake(), timeout=2.0)

    async def stop(self) -> None:
        if self.process is not None and self.process.running:
            env = self._env()
            cmd = [_tool("rabbitmqctl"), "-q", "-n", self.node, "stop"]

            def graceful() -> None:
                with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                    subprocess.run(
                        cmd,
                        env={**os.environ, **env},
                        cwd=self.workdir,
                        capture_output=True,
                        timeout=_STOP_TIMEOUT_S,
                        check=False,
                    )
                if self.process is not None:
                    self.process.wait_exit(_STOP_TIMEOUT_S)

            await asyncio.to_thread(graceful)
        await super().stop()  # SIGTERM/SIGKILL whatever is left, epmd included

    async def _connect(self) -> aio_pika.abc.AbstractConnection:
        return await aio_pika.connect(host="127.0.0.1", port=self.port, timeout=10)

    async def create_queue(self, queue: str) -> None:
        connection = await self._connect()
        try:
            channel = await connection.channel()
            await channel.declare_queue(queue, durable=True, arguments=_queue_arguments(self.mode))
        finally:
            await connection.close()

    async def delete_queue(self, queue: str) -> None:
        connection = await self._connect()
        try:
            channel = await connection.channel()
            await channel.queue_delete(queue)
        finally:
            await connection.close()

    async def _open(
        self, queue: str, prefetch: int
    ) -> tuple[
        aio_pika.abc.AbstractConnection, aio_pika.abc.AbstractChannel, aio_pika.abc.AbstractQueue
    ]:
        connection = await self._connect()
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=prefetch)
        declared = await channel.declare_queue(
            queue, durable=True, arguments=_queue_arguments(self.mode)
        )
        return connection, channel, declared

    async def open_session(self, queue: str) -> Session:
        return _RabbitSession(*await self._open(queue, prefetch=1))

    async def open_batcher(self, queue: str) -> Batcher:
        return _RabbitBatcher(*await self._open(queue, prefetch=PREFETCH))

    async def remaining(self, queue: str) -> int:
        connection = await self._connect()
        try:
            channel = await connection.channel()
            declared = await channel.declare_queue(queue, passive=True)
            result = declared.declaration_result
            return int(result.message_count or 0)
        finally:
            await connection.close()
