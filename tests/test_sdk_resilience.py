"""The SDK across broker restarts, and its typed errors.

Consumers (plain, batched) and Workers carry on across a SIGTERM restart and a
kill -9 restart of a real broker, and nothing is lost: every enqueued id is handled
(exact set equality); duplicates, which at-least-once delivery allows around a
restart, are counted and bounded by what the consumer held. A broker that stays
away ends a consumer with `BrokerUnreachableError` after `reconnect_timeout`; a
broker that is back is usable within a fraction of a second. Deadlines raise
`DeadlineExceededError`, a closed client `ClientClosedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from support import ServerFactory, unique
from support import until as poll_until
from support.sdk_fakes import fake_broker, silent_stream, sleeper, unary

from fila.testing.server import ServerProcess
from fila.v1 import service_pb2
from fila_sdk import (
    AsyncClient,
    BrokerUnreachableError,
    Client,
    ClientClosedError,
    DeadlineExceededError,
    FilaError,
    Message,
    MessageNotFoundError,
    UnavailableError,
    Worker,
)

DEADLINE_S = 30.0
VISIBILITY_MS = 5000  # leases held by a crashed stream come back after this
# What a consumer's ack may meet around a restart, at-least-once style: the broker is
# down (the message comes back), or the lease ran out meanwhile (it came back
# already). Either way the message is delivered again: a counted duplicate.
ACK_LOST = (UnavailableError, MessageNotFoundError)


@contextlib.contextmanager
def ack_may_be_lost() -> Iterator[None]:
    """Suppresses `ACK_LOST`, and CANCELLED: a broker stopping on SIGTERM cancels an
    ack it had not started serving (`fila_sdk.retry.RETRYABLE_CODES`), and the message
    comes back as after the other two."""
    try:
        yield
    except ACK_LOST:
        pass
    except FilaError as exc:
        if exc.code != grpc.StatusCode.CANCELLED:
            raise


def wait(
    predicate: Callable[[], object],
    what: str,
    timeout: float = DEADLINE_S,
    why: Callable[[], str] = lambda: "",
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what} {why()}")
        time.sleep(0.02)


def restart(server: ServerProcess, how: str) -> None:
    """Stops the broker (gracefully or with SIGKILL) and starts it again, SERVING."""
    if how == "sigterm":
        server.stop()
    else:
        server.kill()
    server.start()


def check_nothing_lost(enqueued: list[str], handled: Counter[str], bound: int) -> int:
    """Every enqueued id handled, nothing else; returns the duplicates (checked <= bound)."""
    missing, unexpected = set(enqueued) - set(handled), set(handled) - set(enqueued)
    assert not missing and not unexpected, f"missing {len(missing)}, unexpected {len(unexpected)}"
    duplicates = sum(handled.values()) - len(handled)
    assert duplicates <= bound, f"{duplicates} duplicates, at most {bound} expected"
    return duplicates


def ids(results: list[str | FilaError]) -> list[str]:
    assert all(isinstance(r, str) for r in results), results
    return [r for r in results if isinstance(r, str)]


# --- consumers across restarts ------------------------------------------------------


@pytest.mark.parametrize("how", ["sigterm", "kill"])
def test_sync_consume_carries_on_across_a_restart(
    server_factory: ServerFactory, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fila_sdk")
    server = server_factory()
    with Client(server.addr) as c:
        name = unique("sc")
        c.create_queue(name, visibility_timeout_ms=VISIBILITY_MS)
        enqueued = ids(c.enqueue_many(name, [b"%d" % i for i in range(100)]))
        handled: Counter[str] = Counter()
        errors: list[BaseException] = []

        def consume() -> None:
            try:
                for message in c.consume(name):
                    handled[message.id] += 1
                    time.sleep(0.005)  # some work, so the restart finds it busy
                    with contextlib.suppress(ClientClosedError), ack_may_be_lost():
                        c.ack(name, message.id)
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=consume)
        thread.start()
        wait(lambda: len(handled) >= 30, "30 messages before the restart")
        restart(server, how)
        c.wait_ready(DEADLINE_S)  # one-shot calls fail fast until the channel reconnects
        enqueued += ids(c.enqueue_many(name, [b"after %d" % i for i in range(100)]))
        wait(
            lambda: set(handled) >= set(enqueued),
            "every message after the restart",
            why=lambda: (
                f"{len(set(enqueued) - set(handled))} missing, {c.get_stats(name)}, "
                f"consumer errors {errors!r}"
            ),
        )
        c.close()
        thread.join(DEADLINE_S)
        assert not thread.is_alive() and errors == []
    check_nothing_lost(enqueued, handled, bound=16)  # the default consumer_buffer
    logged = caplog.text
    assert "lost the broker" in logged and "reconnected" in logged


@pytest.mark.parametrize("how", ["sigterm", "kill"])
def test_batched_async_consume_carries_on_across_a_restart(
    server_factory: ServerFactory, how: str
) -> None:
    server = server_factory()

    async def scenario() -> Counter[str]:
        async with AsyncClient(server.addr) as c:
            name = unique("ac")
            await c.create_queue(name, visibility_timeout_ms=VISIBILITY_MS)
            enqueued = ids(await c.enqueue_many(name, [b"%d" % i for i in range(300)]))
            handled: Counter[str] = Counter()

            async def consume() -> None:
                async for message in c.consume(name, prefetch=40, max_batch=20):
                    handled[message.id] += 1
                    await asyncio.sleep(0.002)
                    with ack_may_be_lost():
                        await c.ack(name, message.id)

            task = asyncio.create_task(consume())
            await until(lambda: len(handled) >= 50, "50 before the restart")
            await asyncio.to_thread(restart, server, how)
            await c.wait_ready(DEADLINE_S)
            enqueued += ids(await c.enqueue_many(name, [b"a%d" % i for i in range(300)]))
            await until(lambda: set(handled) >= set(enqueued), "every message")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            check_nothing_lost(enqueued, handled, bound=40)
            return handled

    asyncio.run(scenario())


async def until(predicate: Callable[[], object], what: str, within: float = DEADLINE_S) -> None:
    await poll_until(predicate, what, within)


def no_stream_settled_an_unknown_id(caplog: pytest.LogCaptureFixture) -> None:
    """A worker never names, on a stream, an id that stream does not hold (the broker
    would end the stream): handlers of a lost stream settle by unary calls."""
    ended = [r.getMessage() for r in caplog.records if "is not leased" in r.getMessage()]
    assert not [m for m in ended if "resubscribing" in m], ended


@pytest.mark.parametrize("how", ["sigterm", "kill"])
def test_async_worker_carries_on_across_a_restart(
    server_factory: ServerFactory, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fila_sdk")
    server = server_factory()

    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("aw")
            await c.create_queue(name, visibility_timeout_ms=VISIBILITY_MS)
            # the first message's handler runs across the restart and settles after it
            enqueued = ids(await c.enqueue_many(name, [b"slow"] + [b"%d" % i for i in range(400)]))
            handled: Counter[str] = Counter()
            slow_started = asyncio.Event()

            async def handle(message: Message) -> None:
                if message.payload == b"slow":  # spans the restart: settled after it
                    slow_started.set()
                    await asyncio.sleep(3)
                await asyncio.sleep(0.005)
                handled[message.id] += 1

            worker = Worker(c, name, handle, concurrency=8, prefetch=32)
            async with worker:
                await asyncio.wait_for(slow_started.wait(), DEADLINE_S)
                await until(lambda: len(handled) >= 80, "80 before the restart")
                await asyncio.to_thread(restart, server, how)
                await c.wait_ready(DEADLINE_S)
                enqueued += ids(await c.enqueue_many(name, [b"a%d" % i for i in range(400)]))
                await until(lambda: set(handled) >= set(enqueued), "every message")
                await until(lambda: _settled(c, name), "the queue settled")
            assert worker.stats.resubscribed >= 1
            check_nothing_lost(enqueued, handled, bound=32)

    asyncio.run(scenario())
    no_stream_settled_an_unknown_id(caplog)


async def _settled(c: AsyncClient, name: str) -> bool:
    stats = await c.get_stats(name)
    return (stats.depth, stats.in_flight) == (0, 0)


@pytest.mark.parametrize("how", ["sigterm", "kill"])
def test_thread_worker_carries_on_across_a_restart(
    server_factory: ServerFactory, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fila_sdk")
    server = server_factory()
    with Client(server.addr) as c:
        name = unique("tw")
        c.create_queue(name, visibility_timeout_ms=VISIBILITY_MS)
        # the first message's handler runs across the restart and settles after it
        enqueued = ids(c.enqueue_many(name, [b"slow"] + [b"%d" % i for i in range(200)]))
        handled: Counter[str] = Counter()
        lock = threading.Lock()
        slow_started = threading.Event()

        def handle(message: Message) -> None:
            if message.payload == b"slow":  # spans the restart: settled after it
                slow_started.set()
                time.sleep(3)
            time.sleep(0.005)
            with lock:
                handled[message.id] += 1

        with Worker(c, name, handle, concurrency=4, prefetch=12) as worker:
            assert slow_started.wait(DEADLINE_S)
            wait(lambda: len(handled) >= 40, "40 before the restart")
            restart(server, how)
            c.wait_ready(DEADLINE_S)
            enqueued += ids(c.enqueue_many(name, [b"a%d" % i for i in range(200)]))
            wait(lambda: set(handled) >= set(enqueued), "every message")
            wait(lambda: c.get_stats(name).in_flight == 0, "the queue settled")
        assert worker.stats.resubscribed >= 1
        check_nothing_lost(enqueued, handled, bound=12)
    no_stream_settled_an_unknown_id(caplog)


def test_enqueue_opens_a_new_stream_after_the_broker_restarts(
    server_factory: ServerFactory,
) -> None:
    """The enqueue stream dies with the broker; enqueues in flight then fail with a
    typed error (whether they were stored is unknown), and the next enqueue opens a
    new stream, on both clients."""
    server = server_factory()

    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("reopen")
            await c.create_queue(name)
            before = await c.enqueue(name, None, b"before")
            await asyncio.to_thread(server.kill)
            with pytest.raises(UnavailableError):
                await c.enqueue(name, None, b"while down")
            await asyncio.to_thread(server.start)
            await c.wait_ready(DEADLINE_S)
            async with asyncio.timeout(DEADLINE_S):
                after = await asyncio.gather(*(c.enqueue(name, None, b"a") for _ in range(20)))
            assert len({before, *after}) == 21
            stats = await c.get_stats(name)
            assert stats.depth in (21, 22)  # "while down" may or may not have been stored

    asyncio.run(scenario())
    with Client(server.addr) as sync:
        name = unique("sreopen")
        sync.create_queue(name)
        sync.enqueue(name, None, b"before")
        restart(server, "sigterm")
        sync.wait_ready(DEADLINE_S)
        sync.enqueue(name, None, b"after")
        assert sync.get_stats(name).depth == 2


# --- giving up, and coming back promptly --------------------------------------------


def test_consumers_give_up_when_the_broker_stays_away(server_factory: ServerFactory) -> None:
    server = server_factory()
    with Client(server.addr, reconnect_timeout=1.0) as c:
        name = unique("gone")
        c.create_queue(name)
        c.enqueue(name, None, b"one")
        stream = c.consume(name)
        next(stream)
        server.stop()
        started = time.monotonic()
        with pytest.raises(BrokerUnreachableError, match="reconnect_timeout"):
            next(stream)
        assert 0.9 <= time.monotonic() - started < 5.0

    server.start()

    async def scenario() -> None:
        async with AsyncClient(server.addr, reconnect_timeout=1.0) as ac:

            async def handle(message: Message) -> None:
                return None

            worker = Worker(ac, name, handle)
            run = asyncio.create_task(worker.run())
            await asyncio.sleep(0.3)
            await asyncio.to_thread(server.stop)
            started = time.monotonic()
            with pytest.raises(BrokerUnreachableError):
                await asyncio.wait_for(run, DEADLINE_S)
            assert time.monotonic() - started < 5.0
            with pytest.raises(BrokerUnreachableError):
                await anext(ac.consume(name))

    asyncio.run(scenario())


def test_a_client_is_usable_promptly_once_the_broker_is_back(
    server_factory: ServerFactory,
) -> None:
    """The issue measured 2.4 s with gRPC's default reconnect backoff for a client that
    kept calling while the broker was down; with the SDK's channel options the next
    call succeeds within a second of the broker serving again, and a consumer
    resumes as fast."""
    server = server_factory()
    with Client(server.addr) as c:
        name = unique("prompt")
        c.create_queue(name)
        received: list[tuple[float, Message]] = []

        def consume() -> None:
            for message in c.consume(name):
                received.append((time.monotonic(), message))
                with contextlib.suppress(ClientClosedError), ack_may_be_lost():
                    c.ack(name, message.id)

        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        c.enqueue(name, None, b"before")
        wait(lambda: len(received) == 1, "the first message")
        server.kill()
        failures = 0
        down_until = time.monotonic() + 3.0  # long enough for gRPC's backoff to grow
        while time.monotonic() < down_until:
            try:
                c.list_queues()
            except UnavailableError:
                failures += 1
            time.sleep(0.05)
        assert failures > 0
        server.start()
        back = time.monotonic()
        while True:
            try:
                c.list_queues()
                break
            except UnavailableError:
                time.sleep(0.01)
        assert time.monotonic() - back < 1.0
        c.enqueue(name, None, b"after")
        wait(lambda: len(received) == 2, "the consumer to resume")
        assert received[1][0] - back < 1.5
        c.close()
        thread.join(DEADLINE_S)


# --- typed errors -------------------------------------------------------------------


def test_deadlines_raise_deadline_exceeded() -> None:
    def handlers(b: Any) -> dict[str, Any]:
        return {
            "ExtendLease": unary(
                "ExtendLease",
                service_pb2.ExtendLeaseRequest,
                sleeper(5, service_pb2.ExtendLeaseResponse()),
                b,
            ),
            "AckBatch": unary(
                "AckBatch",
                service_pb2.AckBatchRequest,
                sleeper(5, service_pb2.AckBatchResponse()),
                b,
            ),
            "StreamEnqueue": silent_stream("StreamEnqueue", service_pb2.StreamEnqueueRequest, b),
        }

    with fake_broker(handlers) as fake:
        with Client(fake.addr, timeout=0.3) as c:
            with pytest.raises(DeadlineExceededError) as err:
                c.extend_lease("q", "m")
            assert isinstance(err.value, FilaError)
            with pytest.raises(DeadlineExceededError):
                c.enqueue("q", None, b"x")  # the stream never answers
            result = c.ack_many("q", ["m"])
            assert isinstance(result[0], DeadlineExceededError)

        async def scenario() -> None:
            async with AsyncClient(fake.addr, timeout=0.3) as ac:
                with pytest.raises(DeadlineExceededError):
                    await ac.extend_lease("q", "m")
                outcomes = await asyncio.gather(
                    ac.enqueue("q", None, b"x"),
                    ac.enqueue("q", None, b"y"),
                    ac.ack("q", "m"),
                    return_exceptions=True,
                )
                assert [type(o) for o in outcomes] == [DeadlineExceededError] * 3

        asyncio.run(scenario())


def test_a_closed_client_raises_client_closed(server: ServerProcess) -> None:
    c = Client(server.addr)
    name = unique("closed")
    c.create_queue(name)
    c.enqueue(name, None, b"x")  # starts the stream machinery, which close() must stop
    c.close()
    c.close()  # twice is fine
    calls: list[Callable[[], object]] = [
        lambda: c.enqueue(name, None, b"x"),
        lambda: c.enqueue_many(name, [b"x"]),
        lambda: c.ack(name, "m"),
        lambda: c.nack(name, "m"),
        lambda: c.ack_many(name, ["m"]),
        lambda: c.extend_lease(name, "m"),
        lambda: c.consume(name),
        lambda: c.list_queues(),
        lambda: c.get_stats(name),
        lambda: c.wait_ready(1),
    ]
    for call in calls:
        with pytest.raises(ClientClosedError):
            call()

    async def scenario() -> None:
        ac = AsyncClient(server.addr)
        pending = asyncio.create_task(ac.enqueue(name, None, b"in flight"))
        await asyncio.sleep(0)
        await ac.close()
        with contextlib.suppress(ClientClosedError):
            await pending  # answered before the close, or failed by it
        for coro in (
            ac.enqueue(name, None, b"x"),
            ac.enqueue_many(name, [b"x"]),
            ac.ack(name, "m"),
            ac.nack(name, "m"),
            ac.ack_many(name, ["m"]),
            ac.extend_lease(name, "m"),
            ac.list_queues(),
            ac.create_queue(unique("x")),
        ):
            with pytest.raises(ClientClosedError):
                await coro
        with pytest.raises(ClientClosedError):
            ac.consume(name)

    asyncio.run(scenario())
