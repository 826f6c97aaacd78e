"""`Worker` against handlers and callers that do the unexpected, on a real broker: a
handler of the wrong kind, one that raises SystemExit, KeyboardInterrupt or its own
CancelledError, or an error text larger than a request may be; a client closed
while the worker waits for the broker; stop() before a run and runs after a stop.

The rule throughout: a message is acked only if its handler ran to the end, a
handler's failure is a nack and the worker carries on, and what is not a failure
of one message ends the worker with an exception its caller sees.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
from support import unique
from support.worker import DEADLINE_S, until, wait
from support.worker import counts as _counts

from fila.testing.server import ServerProcess
from fila_sdk import AsyncClient, Client, ClientClosedError, Message, ThreadWorker, Worker
from fila_sdk.batching import MAX_ERROR_BYTES, TRUNCATED_MARK
from fila_sdk.retry import Backoff

# Dead-letters a nack whose text was cut by the SDK (anything else retries), so a DLQ
# arrival proves the bounded text reached the broker.
DLQ_ON_TRUNCATED = f"""
function on_failure(msg)
  if #msg.error <= {MAX_ERROR_BYTES} and string.sub(msg.error, -{len(TRUNCATED_MARK)}) ==
      "{TRUNCATED_MARK}" then
    return {{ action = "dlq" }}
  end
  return {{ action = "retry" }}
end
"""


async def _acounts_are(c: AsyncClient, name: str, want: tuple[int, int]) -> bool:
    stats = await c.get_stats(name)
    return (stats.depth, stats.in_flight) == want


def _run_in_thread(worker: ThreadWorker) -> list[BaseException]:
    """`worker.run()` in a thread of its own, joined with a deadline (a run that
    never returns fails the test instead of hanging it); what it raised, if anything."""
    raised: list[BaseException] = []

    def serve() -> None:
        try:
            worker.run(stop_on_signals=False)
        except BaseException as exc:  # what the test looks at
            raised.append(exc)

    runner = threading.Thread(target=serve, daemon=True)
    runner.start()
    runner.join(DEADLINE_S)
    assert not runner.is_alive(), "run() did not return"
    return raised


# --- the wrong kind of handler -------------------------------------------------------


def test_a_thread_worker_refuses_an_async_handler_and_never_acks_an_awaitable(
    server: ServerProcess,
) -> None:
    """An async handler on a `Client` would return a coroutine nobody runs; acking
    that would delete a message whose handler never ran."""
    ran: list[bytes] = []

    async def handler(message: Message) -> None:
        ran.append(message.payload)

    class AsyncCallable:
        async def __call__(self, message: Message) -> None:
            ran.append(message.payload)

    with Client(server.addr) as c:
        name = unique("kind")
        c.create_queue(name)
        c.enqueue(name, None, b"x")
        for wrong in (handler, AsyncCallable()):
            with pytest.raises(TypeError, match="is async"):
                Worker(c, name, wrong)

        # Hidden behind a plain function: found at run time, not acked, worker ended.
        worker = Worker(c, name, lambda m: handler(m))
        worker.start()
        with pytest.raises(TypeError, match="returned coroutine"):
            worker.join(DEADLINE_S)
        assert ran == [] and (worker.stats.acked, worker.stats.nacked) == (0, 0)
        wait(lambda: _counts(c, name) == (1, 0), "the message back in the queue")


def test_an_async_worker_ends_on_a_sync_handler_instead_of_nacking_forever(
    server: ServerProcess,
) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("kind")
            await c.create_queue(name)
            await c.enqueue_many(name, [b"1", b"2"])
            worker = Worker(c, name, lambda m: None)  # type: ignore[arg-type,return-value]
            with pytest.raises(TypeError, match="needs an async handler"):
                await asyncio.wait_for(worker.run(), DEADLINE_S)
            assert (worker.stats.acked, worker.stats.nacked) == (0, 0)
            await until(lambda: _acounts_are(c, name, (2, 0)), "both messages back in the queue")

    asyncio.run(scenario())


# --- SystemExit and KeyboardInterrupt in a handler ------------------------------------


@pytest.mark.parametrize("raised", [SystemExit, KeyboardInterrupt])
def test_a_handler_exiting_ends_the_thread_worker_and_reaches_its_caller(
    server: ServerProcess, raised: type[BaseException]
) -> None:
    """The handler's thread is not the caller's: the exception must travel to the
    caller of run()/join() (so sys.exit in a handler still exits the program), never
    to the client's loop thread, and the message must not be acked."""
    with Client(server.addr) as c:
        name = unique("exit")
        c.create_queue(name)
        c.enqueue(name, None, b"x")

        def handler(message: Message) -> None:
            raise raised("handler gave up")

        worker = Worker(c, name, handler)
        outcome = _run_in_thread(worker)
        assert [type(e) for e in outcome] == [raised]
        assert (worker.stats.acked, worker.stats.nacked) == (0, 0)
        wait(lambda: _counts(c, name) == (1, 0), "the message back in the queue")
        assert c.enqueue(name, None, b"after")  # the client's loop still serves
        worker.stop()  # a no-op stop for the next run, not RuntimeError
    assert c.closed


# --- CancelledError raised by a handler ----------------------------------------------


def test_an_async_handler_raising_cancelled_error_is_nacked_and_the_worker_carries_on(
    server: ServerProcess,
) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("cancel")
            await c.create_queue(name)
            await c.enqueue_many(name, [b"%d" % i for i in range(10)])
            handled: Counter[bytes] = Counter()

            async def handler(message: Message) -> None:
                handled[message.payload] += 1
                if message.payload == b"0" and message.attempt_count == 0:
                    cancelled = asyncio.get_running_loop().create_future()
                    cancelled.cancel()
                    await cancelled  # another component's cancellation, not the worker's

            worker = Worker(c, name, handler, concurrency=4)
            run = asyncio.create_task(worker.run())
            await until(lambda: worker.stats.acked == 10 or run.done(), "every message acked")
            assert not run.done(), "the worker stopped by itself"
            assert worker.stats.nacked == 1 and handled[b"0"] == 2
            worker.stop()
            await asyncio.wait_for(run, DEADLINE_S)

    asyncio.run(scenario())


# --- closing the client while the worker waits for the broker -------------------------
#
# Without backoff, the worker waits for the broker in its probe at once: a close that
# ends the probe must not read as a requested stop.


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Backoff, "delay", lambda self, attempt: 0.0)


@pytest.mark.usefixtures("no_backoff")
def test_closing_an_async_client_under_a_reconnecting_worker_raises(
    server: ServerProcess,
) -> None:
    async def scenario() -> None:
        c = AsyncClient(server.addr, reconnect_timeout=60)
        name = unique("gone")
        await c.create_queue(name)

        async def handler(message: Message) -> None:
            return None

        worker = Worker(c, name, handler)
        run = asyncio.create_task(worker.run())
        await until(lambda: _subscribed(c, name), "the worker subscribed")
        server.kill()
        await until(lambda: worker.stats.resubscribed >= 1, "the worker reconnecting")
        await c.close()
        with pytest.raises(ClientClosedError):
            await asyncio.wait_for(run, DEADLINE_S)

    asyncio.run(scenario())


async def _subscribed(c: AsyncClient, name: str) -> bool:
    return (await c.get_stats(name)).active_consumers == 1


@pytest.mark.usefixtures("no_backoff")
def test_closing_a_client_under_a_reconnecting_thread_worker_raises(
    server: ServerProcess,
) -> None:
    c = Client(server.addr, reconnect_timeout=60)
    name = unique("gone")
    c.create_queue(name)
    worker = Worker(c, name, lambda m: None)
    worker.start()
    wait(lambda: c.get_stats(name).active_consumers == 1, "the worker subscribed")
    server.kill()
    wait(lambda: worker.stats.resubscribed >= 1, "the worker reconnecting")
    c.close()
    with pytest.raises(ClientClosedError):
        worker.join(DEADLINE_S)


# --- stop() before a run, and runs after a stop ----------------------------------------


def test_a_stop_before_the_run_is_honoured_and_a_stopped_worker_runs_again(
    server: ServerProcess,
) -> None:
    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("again")
            await c.create_queue(name)
            handled: list[bytes] = []

            async def handler(message: Message) -> None:
                handled.append(message.payload)

            worker = Worker(c, name, handler)
            worker.stop()
            await asyncio.wait_for(worker.run(), DEADLINE_S)  # returns at once
            for payload in (b"1", b"2"):
                await c.enqueue(name, None, payload)
                run = asyncio.create_task(worker.run())
                await until(lambda p=payload: p in handled, f"{payload!r} handled")
                worker.stop()
                await asyncio.wait_for(run, DEADLINE_S)
            assert handled == [b"1", b"2"]

    asyncio.run(scenario())

    with Client(server.addr) as c:
        name = unique("again")
        c.create_queue(name)
        handled: list[bytes] = []
        worker = Worker(c, name, lambda m: handled.append(m.payload))
        worker.stop()
        worker.start()
        worker.join(DEADLINE_S)  # returns at once: TimeoutError if the stop was dropped
        for payload in (b"1", b"2"):
            c.enqueue(name, None, payload)
            with worker:
                wait(lambda p=payload: p in handled, f"{payload!r} handled")
        assert handled == [b"1", b"2"]


# --- an error text larger than a request may be ---------------------------------------


def test_a_huge_handler_error_is_cut_and_the_worker_carries_on(server: ServerProcess) -> None:
    """A 20 MB exception text would make a settlement request over the broker's
    16 MiB limit, which fails the stream and ended the worker."""

    async def scenario() -> None:
        async with AsyncClient(server.addr) as c:
            name = unique("huge")
            await c.create_queue(name, on_failure=DLQ_ON_TRUNCATED)
            await c.enqueue_many(name, [b"huge", b"fine"])

            async def handler(message: Message) -> None:
                if message.payload == b"huge":
                    raise ValueError("E" * 20_000_000)

            worker = Worker(c, name, handler)
            run = asyncio.create_task(worker.run())
            await until(
                lambda: run.done() or _acounts_are(c, f"{name}.dlq", (1, 0)),
                "the cut error text to reach the broker",
            )
            await until(lambda: run.done() or worker.stats.acked == 1, "the next message")
            assert not run.done(), "the worker ended"
            worker.stop()
            await asyncio.wait_for(run, DEADLINE_S)

    asyncio.run(scenario())
