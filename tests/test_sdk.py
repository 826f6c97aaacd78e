"""fila_sdk against a real broker (sync and async), plus a fake servicer for the
client-side behaviour a healthy broker never triggers (keepalive frames, errors
without the error-kind trailer).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from support import ServerFactory, unique, wait_until

from fila.testing.children import free_port
from fila.testing.server import ServerProcess
from fila.v1 import messages_pb2, service_pb2, service_pb2_grpc
from fila_sdk import (
    AsyncClient,
    Client,
    ConfigKeyNotFoundError,
    FilaError,
    InvalidArgumentError,
    Message,
    MessageNotFoundError,
    QueueAlreadyExistsError,
    QueueNotFoundError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

DEADLINE_S = 10.0

ON_ENQUEUE = """
function on_enqueue(msg)
  return {
    fairness_key = msg.headers["tenant"] or "default",
    weight = tonumber(msg.headers["weight"] or "1"),
    throttle_keys = { msg.headers["throttle"] },
  }
end
"""
ON_FAILURE_DLQ = """
function on_failure(msg)
  return { action = "dlq" }
end
"""


class Consumer:
    """Runs `Client.consume` on a thread so a test can wait for messages with a deadline."""

    def __init__(self, addr: str, queue_name: str) -> None:
        self.client = Client(addr)
        self.queue = queue_name
        self.received: queue.Queue[Message] = queue.Queue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for message in self.client.consume(self.queue):
                self.received.put(message)
        except BaseException as exc:  # surfaced by close()
            self.error = exc

    def next(self, timeout: float = DEADLINE_S) -> Message:
        try:
            return self.received.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no message from {self.queue!r} within {timeout}s (error: {self.error})")

    def close(self) -> None:
        """Closing the client must end the blocked iterator quietly."""
        self.client.close()
        self._thread.join(DEADLINE_S)
        assert not self._thread.is_alive(), "consume iterator did not end after close()"
        assert self.error is None, f"consume raised on close: {self.error!r}"


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.addr) as c:
        yield c


# --- sync client against the broker -------------------------------------------------


def test_enqueue_consume_ack_lifecycle(server: ServerProcess, client: Client) -> None:
    name = unique("life")
    assert client.create_queue(name)
    msg_id = client.enqueue(name, {"k": "v"}, b"hello")
    assert msg_id

    consumer = Consumer(server.addr, name)
    try:
        msg = consumer.next()
        assert msg.id == msg_id
        assert msg.queue == name
        assert msg.headers == {"k": "v"}
        assert msg.payload == b"hello"
        assert msg.fairness_key == "default"
        assert msg.weight == 1
        assert msg.throttle_keys == ()
        assert msg.attempt_count == 0
        assert msg.enqueued_at is not None and msg.enqueued_at.tzinfo is not None
        assert msg.leased_at is not None and msg.leased_at >= msg.enqueued_at
        assert client.get_stats(name).in_flight == 1

        consumer.client.ack(name, msg.id)
        wait_until(
            lambda: client.get_stats(name).in_flight == 0, DEADLINE_S, what="ack to clear the lease"
        )
        assert client.get_stats(name).depth == 0
        with pytest.raises(MessageNotFoundError):
            consumer.client.ack(name, msg.id)
    finally:
        consumer.close()


def test_nack_redelivers_with_incremented_attempt_count(
    server: ServerProcess, client: Client
) -> None:
    name = unique("nack")
    client.create_queue(name)
    msg_id = client.enqueue(name, None, b"x")
    consumer = Consumer(server.addr, name)
    try:
        first = consumer.next()
        assert (first.id, first.attempt_count) == (msg_id, 0)
        consumer.client.nack(name, first.id, "boom")
        second = consumer.next()
        assert (second.id, second.attempt_count) == (msg_id, 1)
        consumer.client.ack(name, second.id)
    finally:
        consumer.close()


def test_error_classes(client: Client) -> None:
    missing = unique("missing")
    with pytest.raises(QueueNotFoundError) as not_found:
        client.enqueue(missing, None, b"x")
    assert not_found.value.code == grpc.StatusCode.NOT_FOUND
    assert missing in not_found.value.message
    with pytest.raises(QueueNotFoundError):
        client.get_stats(missing)
    with pytest.raises(QueueNotFoundError):
        client.delete_queue(missing)
    with pytest.raises(QueueNotFoundError):
        next(iter(client.consume(missing)))

    name = unique("dup")
    client.create_queue(name)
    with pytest.raises(QueueAlreadyExistsError) as exists:
        client.create_queue(name)
    assert exists.value.code == grpc.StatusCode.ALREADY_EXISTS

    for bad in ("", "has space", "x" * 256):
        with pytest.raises(InvalidArgumentError) as invalid:
            client.create_queue(bad)
        assert invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidArgumentError):
        client.create_queue(unique("badlua"), on_enqueue="this is not lua")

    unknown_id = str(uuid.uuid4())
    with pytest.raises(MessageNotFoundError):
        client.ack(name, unknown_id)
    with pytest.raises(MessageNotFoundError):
        client.nack(name, unknown_id, "nope")
    with pytest.raises(ConfigKeyNotFoundError):
        client.get_config(unique("no.such.key"))
    # every class shares the root, so one except clause catches them all
    with pytest.raises(FilaError):
        client.ack(name, unknown_id)


def test_admin_helpers(client: Client) -> None:
    name = unique("admin")
    queue_id = client.create_queue(name, on_enqueue=ON_ENQUEUE, visibility_timeout_ms=60_000)
    assert queue_id
    names = {q.name for q in client.list_queues()}
    assert {name, f"{name}.dlq"} <= names

    throttle = unique("t")
    client.set_config(f"throttle.{throttle}", "5,10")
    client.enqueue(name, {"tenant": "a", "weight": "2"}, b"1")
    client.enqueue(name, {"tenant": "a", "weight": "2"}, b"2")
    client.enqueue(name, {"tenant": "b", "throttle": throttle}, b"3")
    info = next(q for q in client.list_queues() if q.name == name)
    assert (info.depth, info.in_flight, info.active_consumers) == (3, 0, 0)

    stats = client.get_stats(name)
    assert (stats.depth, stats.in_flight, stats.active_fairness_keys) == (3, 0, 2)
    assert stats.quantum > 0
    per_key = {k.key: k for k in stats.per_key}
    assert (per_key["a"].pending_count, per_key["a"].weight) == (2, 2)
    assert (per_key["b"].pending_count, per_key["b"].weight) == (1, 1)
    per_throttle = {t.key: t for t in stats.per_throttle}
    assert (per_throttle[throttle].rate_per_second, per_throttle[throttle].burst) == (5.0, 10.0)

    prefix = unique("app")
    client.set_config(f"{prefix}.a", "1")
    client.set_config(f"{prefix}.b", "2")
    assert client.get_config(f"{prefix}.a") == "1"
    listing = client.list_config(prefix)
    assert listing.total_count == 2
    assert [(e.key, e.value) for e in listing.entries] == [
        (f"{prefix}.a", "1"),
        (f"{prefix}.b", "2"),
    ]
    assert client.list_config().total_count >= 3

    client.delete_queue(name)
    names = {q.name for q in client.list_queues()}
    assert name not in names and f"{name}.dlq" not in names


def test_dead_letter_and_redrive(server: ServerProcess, client: Client) -> None:
    name, dlq = (n := unique("dl")), f"{n}.dlq"
    client.create_queue(name, on_failure=ON_FAILURE_DLQ)
    msg_id = client.enqueue(name, {"h": "1"}, b"p")
    consumer = Consumer(server.addr, name)
    try:
        consumer.client.nack(name, consumer.next().id, "fatal")
        wait_until(
            lambda: client.get_stats(dlq).depth == 1,
            DEADLINE_S,
            what="the message to reach the DLQ",
        )
        assert client.get_stats(name).depth == 0
        with pytest.raises(InvalidArgumentError):
            client.redrive(name)  # not a DLQ
        assert client.redrive(dlq) == 1
        again = consumer.next()
        assert (again.id, again.attempt_count, again.headers) == (msg_id, 0, {"h": "1"})
        consumer.client.ack(name, again.id)
    finally:
        consumer.close()


def test_breaking_out_of_consume_cancels_the_stream(client: Client) -> None:
    name = unique("brk")
    client.create_queue(name)
    client.enqueue(name, None, b"x")
    for _ in client.consume(name):
        break
    wait_until(
        lambda: client.get_stats(name).active_consumers == 0, DEADLINE_S, what="the stream to close"
    )


def test_api_key_and_timeout_are_accepted(server: ServerProcess) -> None:
    # Auth is off by default, so a key is carried but ignored; the call must still work.
    with Client(server.addr, api_key="anything", timeout=5.0) as c:
        c.wait_ready(DEADLINE_S)
        assert isinstance(c.list_queues(), list)


def test_unreachable_broker_is_unavailable() -> None:
    with Client(f"127.0.0.1:{free_port()}") as c:
        with pytest.raises(UnavailableError):
            c.list_queues()
        with pytest.raises(UnavailableError):
            c.wait_ready(0.5)


# --- async client against the broker -----------------------------------------------


async def _next(stream: AsyncIterator[Message]) -> Message:
    async with asyncio.timeout(DEADLINE_S):
        return await anext(stream)


def test_async_lifecycle_nack_and_errors(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("alife")
            await c.create_queue(name)
            msg_id = await c.enqueue(name, {"a": "b"}, b"payload")
            async with contextlib.aclosing(c.consume(name)) as stream:
                first = await _next(stream)
                assert (first.id, first.attempt_count, first.payload) == (msg_id, 0, b"payload")
                assert first.headers == {"a": "b"} and first.queue == name
                await c.nack(name, first.id, "retry me")
                second = await _next(stream)
                assert (second.id, second.attempt_count) == (msg_id, 1)
                await c.ack(name, second.id)
                with pytest.raises(MessageNotFoundError):
                    await c.ack(name, second.id)

            with pytest.raises(QueueNotFoundError):
                await _next(c.consume(unique("amissing")))
            with pytest.raises(QueueAlreadyExistsError):
                await c.create_queue(name)
            with pytest.raises(InvalidArgumentError):
                await c.create_queue("bad name")
            with pytest.raises(MessageNotFoundError):
                await c.nack(name, str(uuid.uuid4()))

    asyncio.run(scenario())


def test_async_admin_helpers(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr, timeout=5.0) as c:
            await c.wait_ready(DEADLINE_S)
            name = unique("aadmin")
            await c.create_queue(name, on_enqueue=ON_ENQUEUE)
            await c.enqueue(name, {"tenant": "t1"}, b"")
            assert name in {q.name for q in await c.list_queues()}
            stats = await c.get_stats(name)
            assert stats.depth == 1 and [k.key for k in stats.per_key] == ["t1"]
            key = unique("akey")
            await c.set_config(key, "v")
            assert await c.get_config(key) == "v"
            listing = await c.list_config(key)
            assert listing.total_count == 1 and listing.entries[0].value == "v"
            with pytest.raises(QueueNotFoundError):
                await c.redrive(unique("nope") + ".dlq")
            await c.delete_queue(name)
            with pytest.raises(QueueNotFoundError):
                await c.get_stats(name)

    asyncio.run(scenario())


def test_async_close_ends_consume_quietly(server: ServerProcess) -> None:
    async def scenario() -> None:
        c = AsyncClient(server.addr)
        name = unique("aclose")
        await c.create_queue(name)
        received: list[Message] = []
        got_one = asyncio.Event()

        async def consume() -> None:
            async for message in c.consume(name):
                received.append(message)
                got_one.set()

        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(consume())
            await c.enqueue(name, None, b"1")
            async with asyncio.timeout(DEADLINE_S):
                await got_one.wait()
            await c.close()
            async with asyncio.timeout(DEADLINE_S):
                await task  # ends without raising
        assert len(received) == 1

    asyncio.run(scenario())


# --- client-side behaviour against a fake servicer ---------------------------------


class FakeService(service_pb2_grpc.FilaServiceServicer):
    """Speaks like a foreign broker: keepalive frames and bare status codes, no error kind."""

    def __init__(self) -> None:
        self.metadata: list[tuple[str, str | bytes]] = []

    def Enqueue(self, request: Any, context: grpc.ServicerContext) -> service_pb2.EnqueueResponse:
        self.metadata = list(context.invocation_metadata())
        return service_pb2.EnqueueResponse(message_id="m1")

    def Consume(
        self, request: Any, context: grpc.ServicerContext
    ) -> Iterator[service_pb2.ConsumeResponse]:
        if request.queue == "missing":
            context.abort(grpc.StatusCode.NOT_FOUND, 'queue "missing" not found')
        yield service_pb2.ConsumeResponse()  # keepalive
        yield service_pb2.ConsumeResponse(
            message=messages_pb2.Message(
                id="m1", metadata=messages_pb2.MessageMetadata(queue_id=request.queue)
            )
        )
        yield service_pb2.ConsumeResponse()

    def Ack(self, request: Any, context: grpc.ServicerContext) -> service_pb2.AckResponse:
        context.abort(grpc.StatusCode.NOT_FOUND, "message not leased")

    def Nack(self, request: Any, context: grpc.ServicerContext) -> service_pb2.NackResponse:
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy")


@pytest.fixture
def fake() -> Iterator[tuple[str, FakeService]]:
    servicer = FakeService()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service_pb2_grpc.add_FilaServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", servicer
    srv.stop(None)


def test_keepalives_skipped_and_status_only_errors_mapped(fake: tuple[str, FakeService]) -> None:
    addr, servicer = fake
    with Client(addr, api_key="secret") as c:
        assert c.enqueue("q", None, b"") == "m1"
        assert ("authorization", "Bearer secret") in servicer.metadata
        messages = list(c.consume("q"))
        assert [(m.id, m.queue, m.enqueued_at) for m in messages] == [("m1", "q", None)]
        with pytest.raises(QueueNotFoundError):
            list(c.consume("missing"))
        with pytest.raises(MessageNotFoundError):  # NOT_FOUND on Ack means the message
            c.ack("q", "m1")
        with pytest.raises(ResourceExhaustedError):
            c.nack("q", "m1")

    async def scenario() -> None:
        async with AsyncClient(addr) as ac:
            assert [m.id async for m in ac.consume("q")] == ["m1"]
            with pytest.raises(MessageNotFoundError):
                await ac.ack("q", "m1")

    asyncio.run(scenario())


def test_client_cert_requires_key() -> None:
    with pytest.raises(ValueError, match="together"):
        Client("localhost:1", client_cert=b"cert")


def test_api_key_auth(server_factory: ServerFactory) -> None:
    key = "bootstrap-" + uuid.uuid4().hex
    srv = server_factory(env={"FILA_BOOTSTRAP_APIKEY": key})
    with Client(srv.addr) as anonymous, pytest.raises(UnauthenticatedError):
        anonymous.list_queues()
    with Client(srv.addr, api_key="wrong") as wrong, pytest.raises(UnauthenticatedError):
        wrong.create_queue(unique("x"))
    with Client(srv.addr, api_key=key) as c:
        name = unique("auth")
        c.create_queue(name)
        assert name in {q.name for q in c.list_queues()}

    async def scenario() -> None:
        async with AsyncClient(srv.addr, api_key=key) as ac:
            assert await ac.enqueue(name, None, b"x")
        async with AsyncClient(srv.addr) as anon:
            with pytest.raises(UnauthenticatedError):
                await anext(anon.consume(name))

    asyncio.run(scenario())
