"""`Worker` against a real broker: ack on return, nack with the exception's text on
raise, the concurrency bound, refill without polling, lease extension for long
handlers, and graceful stop (settle what ran, release what was held), for the async
worker (`AsyncClient`) and the thread-pool one (`Client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections import Counter

import pytest
from support import unique
from support.sdk_fakes import ScriptedConsume, fake_broker
from support.worker import DEADLINE_S, until, wait
from support.worker import counts as _counts

from fila.testing.server import ServerProcess
from fila.v1 import messages_pb2
from fila_sdk import (
    AsyncClient,
    AsyncWorker,
    Client,
    ClientClosedError,
    Message,
    QueueNotFoundError,
    ThreadWorker,
    Worker,
)

# Dead-letters a nack only when its error text is exactly the handler's exception
# text; any other text retries, so a DLQ arrival proves the text reached the broker.
DLQ_ON_EXACT_TEXT = """
function on_failure(msg)
  if msg.error == "bad order 7" then return { action = "dlq" } end
  return { action = "retry" }
end
"""


def test_worker_type_follows_the_client_and_errors_are_raised(server: ServerProcess) -> None:
    async def handler(message: Message) -> None:
        return None

    with Client(server.addr) as c:
        assert isinstance(Worker(c, "q", lambda m: None), ThreadWorker)
        with pytest.raises(ValueError, match="prefetch"):
            Worker(c, "q", lambda m: None, concurrency=4, prefetch=2)
        with pytest.raises(QueueNotFoundError):
            Worker(c, unique("missing"), lambda m: None).run()

    async def scenario() -> None:
        async with AsyncClient(server.addr) as ac:
            worker = Worker(ac, unique("missing"), handler)
            assert isinstance(worker, AsyncWorker)
            with pytest.raises(QueueNotFoundError):
                await asyncio.wait_for(worker.run(), DEADLINE_S)

    asyncio.run(scenario())


# --- async worker -------------------------------------------------------------------


def test_async_worker_acks_on_return_and_nacks_with_the_exception_text(
    server: ServerProcess,
) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("w")
            await c.create_queue(name, on_failure=DLQ_ON_EXACT_TEXT)
            ids = await c.enqueue_many(name, [b"%d" % i for i in range(40)])
            handled: Counter[str] = Counter()

            async def handle(message: Message) -> None:
                handled[message.id] += 1
                if message.payload == b"7":
                    raise ValueError("bad order 7")

            worker = Worker(c, name, handle, concurrency=4)
            async with worker:
                await until(lambda: len(handled) == 40, "every message handled")
                await until(
                    lambda: _depth_and_flight(c, f"{name}.dlq", (1, 0)),
                    "the failed message in the DLQ",
                )
                await until(lambda: _depth_and_flight(c, name, (0, 0)), "the queue empty")
            assert set(handled) == set(ids) and set(handled.values()) == {1}
            assert (worker.stats.acked, worker.stats.nacked) == (39, 1)

    asyncio.run(scenario())


async def _depth_and_flight(c: AsyncClient, name: str, want: tuple[int, int]) -> bool:
    stats = await c.get_stats(name)
    return (stats.depth, stats.in_flight) == want


def test_async_worker_respects_concurrency_and_refills_at_once(server: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("conc")
            await c.create_queue(name)
            await c.enqueue_many(name, [b"x"] * 30)
            running = 0
            peak = 0
            done = 0

            async def handle(message: Message) -> None:
                nonlocal running, peak, done
                running += 1
                peak = max(peak, running)
                await asyncio.sleep(0.02)
                running -= 1
                done += 1

            async with Worker(c, name, handle, concurrency=3, prefetch=10):
                await until(lambda: done == 30, "30 messages handled")
            assert peak == 3

            # Refill without polling: an idle worker starts a new message as soon as it
            # arrives. Measured from enqueue to handler start against the same path
            # through a bare consume stream on another queue, alternating, so that the
            # machine's load affects both alike; a polling loop would add its interval.
            bare_name = unique("bare")
            await c.create_queue(bare_name)
            started: list[float] = []

            async def record(message: Message) -> None:
                started.append(time.monotonic())

            worker_lags: list[float] = []
            bare_lags: list[float] = []
            async with (
                Worker(c, name, record, concurrency=1),
                contextlib.aclosing(c.consume(bare_name)) as bare,
            ):
                for i in range(9):
                    await asyncio.sleep(0.05)  # idle
                    sent = time.monotonic()
                    await c.enqueue(bare_name, None, b"%d" % i)
                    await asyncio.wait_for(anext(bare), DEADLINE_S)
                    bare_lags.append(time.monotonic() - sent)
                    await asyncio.sleep(0.05)
                    sent = time.monotonic()
                    await c.enqueue(name, None, b"%d" % i)
                    await until(lambda i=i: len(started) == i + 1, "the handler to start")
                    worker_lags.append(started[-1] - sent)
            worker_median = sorted(worker_lags)[4]
            bare_median = sorted(bare_lags)[4]
            assert worker_median < 2 * bare_median + 0.02, (worker_lags, bare_lags)

    asyncio.run(scenario())


def test_async_worker_extends_the_lease_of_a_long_handler(server: ServerProcess) -> None:
    """A 4 s handler on a queue whose visibility timeout is 1.5 s: the worker learns
    the timeout and extends the lease, so no other consumer ever gets the message."""

    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("long")
            await c.create_queue(name, visibility_timeout_ms=1500)
            msg_id = await c.enqueue(name, None, b"slow")
            finished = asyncio.Event()
            started = asyncio.Event()
            attempts: list[int] = []

            async def slow(message: Message) -> None:
                attempts.append(message.attempt_count)
                started.set()
                await asyncio.sleep(4)
                finished.set()

            stolen: list[Message] = []

            async def rival() -> None:
                async for message in c.consume(name):
                    stolen.append(message)

            worker = Worker(c, name, slow)
            async with worker:
                await asyncio.wait_for(started.wait(), DEADLINE_S)
                rival_task = asyncio.create_task(rival())  # waits for a redelivery
                await asyncio.wait_for(finished.wait(), DEADLINE_S)
                await until(lambda: _depth_and_flight(c, name, (0, 0)), "the ack")
                rival_task.cancel()
                await asyncio.gather(rival_task, return_exceptions=True)
            assert stolen == [], "the lease expired and the message was redelivered"
            assert attempts == [0]
            assert worker.stats.extended >= 4  # about every 0.5 s for 4 s
            assert worker.stats.acked == 1
            with pytest.raises(Exception, match="not leased"):
                await c.extend_lease(name, msg_id)

    asyncio.run(scenario())


def test_async_worker_stops_gracefully(server: ServerProcess) -> None:
    """stop(): running handlers finish and are acked, no new one starts, and the stream
    closes so the broker takes back at once what was held (the queue's visibility
    timeout is 30 s: nothing here waits for an expiry); a handler past the grace
    period is cancelled and its message released."""

    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("stop")
            await c.create_queue(name)
            await c.enqueue_many(name, [b"%d" % i for i in range(10)])
            release = asyncio.Event()
            started: list[str] = []

            async def blocked(message: Message) -> None:
                started.append(message.id)
                await release.wait()

            worker = Worker(c, name, blocked, concurrency=2, prefetch=6, grace_period=10)
            run = asyncio.create_task(worker.run())
            await until(lambda: len(started) == 2, "two handlers running")
            await until(lambda: _depth_and_flight(c, name, (4, 6)), "six messages held")
            worker.stop()
            await asyncio.sleep(0.2)
            assert not run.done()  # waiting for the two running handlers
            assert len(started) == 2  # and not starting new ones
            release.set()
            await asyncio.wait_for(run, DEADLINE_S)
            assert (await c.get_stats(name)).active_consumers == 0  # the stream is closed
            # the two acks made room the broker may have filled before the stream closed
            assert worker.stats.acked == 2
            assert worker.stats.released == worker.stats.delivered - 2 >= 4
            await until(
                lambda: _depth_and_flight(c, name, (8, 0)), "two acked, the rest back", within=2
            )

            # Past the grace period: cancelled, its message released.
            stuck = asyncio.Event()

            async def never(message: Message) -> None:
                stuck.set()
                await asyncio.Event().wait()

            worker = Worker(c, name, never, concurrency=1, prefetch=1, grace_period=0.3)
            run = asyncio.create_task(worker.run())
            await asyncio.wait_for(stuck.wait(), DEADLINE_S)
            worker.stop()
            await asyncio.wait_for(run, 0.3 + 5)
            assert (await c.get_stats(name)).active_consumers == 0
            await until(
                lambda: _depth_and_flight(c, name, (8, 0)), "the stuck one released", within=2
            )
            assert (worker.stats.acked, worker.stats.released) == (0, 1)

    asyncio.run(scenario())


def test_a_stopping_worker_settles_on_the_stream_then_half_closes_it() -> None:
    """The protocol of a graceful stop, seen by a stand-in broker: the settlements of
    the handlers that were running arrive on the stream, and then the stream ends by
    a half-close (the broker then gives back the rest), not by a cancellation that
    could drop settlements still in flight."""
    delivered = [
        messages_pb2.Message(id=f"m{i}", payload=b"x", metadata=messages_pb2.MessageMetadata())
        for i in range(3)
    ]
    script = ScriptedConsume(delivered)

    with fake_broker(lambda b: {"StreamConsume": script.handler(b)}) as fake:

        async def scenario() -> None:
            async with AsyncClient(fake.addr) as c:
                release = asyncio.Event()
                started: list[str] = []

                async def handle(message: Message) -> None:
                    started.append(message.id)
                    await release.wait()
                    if message.id == "m1":
                        raise RuntimeError("m1 failed")

                worker = Worker(c, "q", handle, concurrency=2, prefetch=3, visibility_timeout=60)
                run = asyncio.create_task(worker.run())
                await until(lambda: len(started) == 2, "two handlers running")
                worker.stop()
                release.set()
                await asyncio.wait_for(run, DEADLINE_S)

        asyncio.run(scenario())
        assert script.half_closed.wait(DEADLINE_S) and not script.cancelled.is_set()
    opening, *settlements = script.requests
    assert (opening.queue, opening.prefetch) == ("q", 3)
    acks = [i for r in settlements for i in r.ack_ids]
    nacks = [(n.message_id, n.error) for r in settlements for n in r.nacks]
    assert (acks, nacks) == (["m0"], [("m1", "m1 failed")])  # m2 was never started


# --- thread worker ------------------------------------------------------------------


def test_thread_worker_acks_nacks_and_bounds_concurrency(server: ServerProcess) -> None:
    with Client(server.addr) as c:
        name = unique("tw")
        c.create_queue(name, on_failure=DLQ_ON_EXACT_TEXT)
        c.enqueue_many(name, [b"%d" % i for i in range(24)])
        lock = threading.Lock()
        running = peak = 0
        handled: Counter[str] = Counter()

        def handle(message: Message) -> None:
            nonlocal running, peak
            with lock:
                running += 1
                peak = max(peak, running)
                handled[message.id] += 1
            time.sleep(0.03)
            with lock:
                running -= 1
            if message.payload == b"7":
                raise ValueError("bad order 7")

        worker = Worker(c, name, handle, concurrency=3)
        with worker:
            wait(lambda: len(handled) == 24, "every message handled")
            wait(lambda: c.get_stats(f"{name}.dlq").depth == 1, "the failed one in the DLQ")
            wait(lambda: c.get_stats(name).in_flight == 0, "the acks")
        assert peak == 3
        assert set(handled.values()) == {1}
        assert (worker.stats.acked, worker.stats.nacked) == (23, 1)
        assert c.get_stats(name).depth == 0


def test_thread_worker_extends_leases_and_stops_gracefully(server: ServerProcess) -> None:
    with Client(server.addr) as c:
        name = unique("twlong")
        c.create_queue(name, visibility_timeout_ms=1500)
        c.enqueue_many(name, [b"%d" % i for i in range(5)])
        release = threading.Event()
        started: list[Message] = []

        def handle(message: Message) -> None:
            started.append(message)
            release.wait(DEADLINE_S)

        worker = Worker(c, name, handle, concurrency=2, prefetch=4, grace_period=10)
        worker.start()
        wait(lambda: len(started) == 2, "two handlers running")
        time.sleep(3.5)  # over 2 visibility timeouts: leases must be extended meanwhile
        stats = c.get_stats(name)
        assert (stats.depth, stats.in_flight) == (1, 4)
        assert {m.attempt_count for m in started} == {0}
        worker.stop()
        time.sleep(0.1)
        release.set()
        worker.join(DEADLINE_S)
        assert c.get_stats(name).active_consumers == 0  # the stream is closed
        assert worker.stats.extended >= 4
        assert worker.stats.acked == 2
        assert worker.stats.released == worker.stats.delivered - 2 >= 2
        # within less than the 1.5 s visibility timeout: released, not expired
        wait(lambda: _counts(c, name) == (3, 0), "two acked, the rest back", timeout=1.0)


def test_closing_the_client_under_a_thread_worker_ends_it(server: ServerProcess) -> None:
    c = Client(server.addr)
    name = unique("under")
    c.create_queue(name)
    worker = Worker(c, name, lambda m: None)
    worker.start()
    wait(lambda: c.get_stats(name).active_consumers == 1, "the worker subscribed")
    c.close()
    with pytest.raises(ClientClosedError):
        worker.join(DEADLINE_S)


def test_thread_worker_run_stops_on_sigterm(server: ServerProcess) -> None:
    assert threading.current_thread() is threading.main_thread()
    with Client(server.addr) as c:
        name = unique("sig")
        c.create_queue(name)
        c.enqueue_many(name, [b"x"] * 3)
        handled: list[str] = []
        worker = Worker(c, name, lambda m: handled.append(m.id), concurrency=1)

        def terminate_when_done() -> None:
            wait(lambda: len(handled) == 3, "three handled")
            os.kill(os.getpid(), signal.SIGTERM)

        killer = threading.Thread(target=terminate_when_done)
        killer.start()
        previous = signal.getsignal(signal.SIGTERM)
        worker.run()  # returns once SIGTERM stopped it gracefully
        killer.join()
        assert signal.getsignal(signal.SIGTERM) == previous  # restored
        assert worker.stats.acked == 3
        wait(lambda: c.get_stats(name).in_flight == 0, "acks applied")
