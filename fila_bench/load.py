"""Closed-loop load: producers and workers that each keep exactly one request in flight.

Closed-loop numbers measure sustainable throughput, not behaviour under overload: a
producer sends its next enqueue only when the previous one was answered, a worker
acks a message before it counts it. Concurrency is therefore exactly the number of
producers or workers, which is what group commit and the scheduler see.

Every helper is bounded: windows by time, preloads and drains by count and by a
deadline. Drains record each delivery so the caller can run the conservation check
(every enqueued id delivered exactly once) that tells a fast broker from one that
loses or duplicates messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Mapping,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from hdrh.histogram import HdrHistogram

from fila_bench.conn import Connection
from fila_bench.results import Result
from fila_sdk import AsyncClient, Message, Worker

PAYLOAD_1KB = b"x" * 1024
HeadersFor = Callable[[int], Mapping[str, str] | None]


class CheckFailed(Exception):
    """A benchmark's correctness check failed; `results` are what it measured anyway."""

    def __init__(self, message: str, results: Sequence[Result] = ()) -> None:
        super().__init__(message)
        self.results = list(results)


@dataclass(frozen=True, slots=True)
class EnqueueRun:
    rate: float  # answered enqueues per second inside the measurement window
    ids: list[str]  # every id answered, warmup included


async def enqueue_for(
    conns: Sequence[Connection],
    producers: int,
    queue: str,
    *,
    warmup_s: float,
    measure_s: float,
    payload: bytes = PAYLOAD_1KB,
    headers: Mapping[str, str] | None = None,
    max_messages: int = 1_000_000,
) -> EnqueueRun:
    """`producers` closed loops (round-robin over `conns`) for warmup + measure seconds.

    Answers that arrive during the warmup are stored but not counted, so connection
    setup and the first RocksDB writes do not dilute the rate.
    """
    ids: list[str] = []
    counted = 0
    measure_from = time.perf_counter() + warmup_s
    end = measure_from + measure_s

    async def produce(conn: Connection) -> None:
        nonlocal counted
        while len(ids) < max_messages:
            ids.append(await conn.enqueue(queue, headers, payload))
            now = time.perf_counter()
            if now >= end:
                return
            if now >= measure_from:
                counted += 1

    async with asyncio.TaskGroup() as group:
        for i in range(producers):
            group.create_task(produce(conns[i % len(conns)]))
    return EnqueueRun(counted / measure_s, ids)


async def preload(
    conns: Sequence[Connection],
    producers: int,
    queue: str,
    count: int,
    *,
    deadline_s: float,
    payload: bytes = PAYLOAD_1KB,
    headers_for: HeadersFor | None = None,
) -> list[str]:
    """Enqueues exactly `count` messages (message i gets `headers_for(i)`); returns ids."""
    ids: list[str] = []
    next_index = 0

    async def produce(conn: Connection) -> None:
        nonlocal next_index
        while next_index < count:
            index = next_index
            next_index += 1
            headers = headers_for(index) if headers_for is not None else None
            ids.append(await conn.enqueue(queue, headers, payload))

    async with asyncio.timeout(deadline_s), asyncio.TaskGroup() as group:
        for i in range(producers):
            group.create_task(produce(conns[i % len(conns)]))
    if len(set(ids)) != len(ids):
        raise CheckFailed(f"queue {queue}: the broker answered duplicate message ids")
    return ids


@dataclass(frozen=True, slots=True)
class DrainRun:
    # The timed part: from the moment every worker's stream had delivered its first
    # message (all streams open and flowing) to the `limit`-th ack, and the acks in it.
    elapsed_s: float
    counted: int
    limit: int
    # In the order workers finished acking them; may run past `limit` by the few that
    # were acked before the workers were cancelled (kept for the duplicate check).
    deliveries: list[Message]

    @property
    def rate(self) -> float:
        return self.counted / self.elapsed_s if self.elapsed_s > 0 else 0.0


async def consume_until(
    conns: Sequence[Connection],
    workers: int,
    queue: str,
    limit: int,
    *,
    deadline_s: float,
) -> DrainRun:
    """`workers` consume-and-ack loops until `limit` messages are acked.

    Opening a stream is not delivering: the clock starts once every worker has
    received its first message (so connecting, opening N streams and the first
    round trip are outside the window) and counts the acks after that. If the
    backlog is too small for every worker to get one, it starts at the first
    delivery instead. With one worker the delivery list is the broker's lease order,
    which is what the fairness benchmark needs. Workers are cancelled once the limit
    is reached; a worker that fails ends the drain with its error instead of waiting
    for the deadline.
    """
    deliveries: list[Message] = []
    reached = asyncio.Event()
    finished_at = 0.0
    first_at = 0.0
    streams_open = 0
    all_open_at = 0.0
    acked_before_open = 0

    async def work(conn: Connection) -> None:
        nonlocal finished_at, first_at, streams_open, all_open_at, acked_before_open
        first = True
        async for msg in conn.consume(queue):
            if first:
                first = False
                streams_open += 1
                now = time.perf_counter()
                first_at = first_at or now
                if streams_open == workers and not reached.is_set():
                    all_open_at, acked_before_open = now, len(deliveries)
            await conn.ack(queue, msg.id)
            deliveries.append(msg)
            if len(deliveries) == limit:
                finished_at = time.perf_counter()
                reached.set()

    workers_done = [work(conns[i % len(conns)]) for i in range(workers)]
    await run_until(reached, workers_done, deadline_s, lambda: f"{len(deliveries)}/{limit} acked")
    if not all_open_at:  # fewer messages than workers: time from the first delivery
        all_open_at, acked_before_open = first_at, 0
    return DrainRun(finished_at - all_open_at, limit - acked_before_open, limit, deliveries)


async def worker_drain(
    clients: Sequence[AsyncClient], queue: str, limit: int, *, deadline_s: float
) -> DrainRun:
    """One SDK `Worker` per client, one message in flight each (`concurrency=1`), until
    `limit` messages were handled; each is acked on the worker's stream when its
    handler returns, as a user of the SDK drains a queue.

    The window is `consume_until`'s: it opens once every worker has handled its
    first message and closes at the `limit`-th. The workers then stop gracefully,
    settling what they handled, so the caller's emptiness check sees every ack.
    """
    deliveries: list[Message] = []
    reached = asyncio.Event()
    finished_at = first_at = all_open_at = 0.0
    started = 0
    handled_before_open = 0

    def handler() -> Callable[[Message], Awaitable[None]]:
        first = True

        async def handle(msg: Message) -> None:
            nonlocal first, first_at, started, all_open_at, handled_before_open, finished_at
            if first:
                first = False
                started += 1
                now = time.perf_counter()
                first_at = first_at or now
                if started == len(clients) and not reached.is_set():
                    all_open_at, handled_before_open = now, len(deliveries)
            deliveries.append(msg)
            if len(deliveries) == limit:
                finished_at = time.perf_counter()
                reached.set()

        return handle

    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(Worker(client, queue, handler(), concurrency=1))
        try:
            await asyncio.wait_for(reached.wait(), deadline_s)
        except TimeoutError:
            raise CheckFailed(
                f"queue {queue}: {len(deliveries)}/{limit} handled within {deadline_s:g}s"
            ) from None
    if not all_open_at:  # fewer messages than workers: time from the first delivery
        all_open_at, handled_before_open = first_at, 0
    return DrainRun(finished_at - all_open_at, limit - handled_before_open, limit, deliveries)


async def run_until(
    event: asyncio.Event,
    coros: Sequence[Coroutine[Any, Any, None]],
    deadline_s: float,
    progress: Callable[[], str],
) -> None:
    """Runs `coros` as tasks until `event` is set, then cancels and awaits them all.

    A task that raises ends the wait with its error; tasks may finish normally (a
    producer that sent its share), but if all do and `event` is still unset, or the
    deadline passes first, the check fails with `progress()` in the message.
    """
    tasks = {asyncio.create_task(c) for c in coros}
    waiter = asyncio.create_task(event.wait())
    deadline = time.perf_counter() + deadline_s
    try:
        pending: set[asyncio.Task[Any]] = {waiter, *tasks}
        while waiter in pending:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise CheckFailed(f"not finished within {deadline_s:g}s ({progress()})")
            if pending == {waiter}:
                raise CheckFailed(f"every worker stopped before the end ({progress()})")
            done, pending = await asyncio.wait(
                pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done - {waiter}:
                if (exc := task.exception()) is not None:
                    raise exc
    finally:
        for task in [waiter, *tasks]:
            task.cancel()
        await asyncio.gather(waiter, *tasks, return_exceptions=True)


@asynccontextmanager
async def background(*coros: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Runs `coros` while the body runs, then cancels them and re-raises their errors.

    For load that only sets the scene (consumers during an enqueue window, an RSS
    sampler, a latency probe); the body decides when the measurement ends.
    """
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome


def check_exactly_once(what: str, enqueued: Collection[str], delivered: Sequence[str]) -> None:
    """Conservation: every enqueued id delivered once, nothing else delivered."""
    _check(what, enqueued, delivered, require_all=True)


def check_at_most_once(what: str, enqueued: Collection[str], delivered: Sequence[str]) -> None:
    """For partial windows: no duplicates and nothing that was never enqueued."""
    _check(what, enqueued, delivered, require_all=False)


def _check(
    what: str, enqueued: Collection[str], delivered: Sequence[str], require_all: bool
) -> None:
    expected = set(enqueued)
    counts = Counter(delivered)
    duplicated = sorted(i for i, n in counts.items() if n > 1)
    unknown = sorted(counts.keys() - expected)
    missing = sorted(expected - counts.keys()) if require_all else []
    if duplicated or unknown or missing:
        examples = (duplicated + unknown + missing)[:3]
        raise CheckFailed(
            f"{what}: conservation check failed: {len(expected)} enqueued, "
            f"{len(delivered)} delivered, {len(missing)} missing, {len(duplicated)} "
            f"delivered more than once, {len(unknown)} never enqueued (e.g. {examples})"
        )


async def check_empty(admin: AsyncClient, queue: str) -> None:
    """After a full drain the broker itself must agree: nothing ready, nothing leased."""
    stats = await admin.get_stats(queue)
    if stats.depth or stats.in_flight:
        raise CheckFailed(
            f"queue {queue}: drained, yet the broker reports depth {stats.depth}, "
            f"in-flight {stats.in_flight}"
        )


async def check_stored(admin: AsyncClient, queue: str, ids: Collection[str]) -> None:
    """After enqueues alone the broker must hold each answered id once: depth = answers."""
    if len(set(ids)) != len(ids):
        raise CheckFailed(f"queue {queue}: the broker answered the same id twice")
    stats = await admin.get_stats(queue)
    if stats.depth != len(ids):
        raise CheckFailed(
            f"queue {queue}: {len(ids)} enqueues answered, yet the broker reports "
            f"depth {stats.depth}"
        )


async def paced(rate: float, stop: Callable[[], bool]) -> AsyncIterator[float]:
    """Yields the scheduled send time (`perf_counter()` seconds) of each tick of a fixed
    schedule of `rate` per second, until `stop()`.

    The schedule is fixed from the start, so a caller that fell behind (one request
    in flight, a slow answer) gets the overdue ticks back to back until it is on time
    again and the offered rate over the run stays `rate`. Latency must be timed from
    the yielded time, not from when the caller got round to sending: a stall delays
    every send queued behind it, and timing from the actual send would record the
    one slow answer and none of the waiting it caused (coordinated omission, the
    correction HdrHistogram's users apply).
    """
    start = time.perf_counter()
    index = 0
    while not stop():
        scheduled = start + index / rate
        await _until(scheduled)
        yield scheduled
        index += 1


# epoll waits whole milliseconds, rounded up, so `asyncio.sleep(0.0044)` wakes at 5 ms,
# and a paced schedule's sends ran late (docs/benchmarks.md). That lateness is the load
# generator's, yet a latency timed from the schedule would charge it to the broker.
_TIMER_SLACK_S = 0.0015


async def _until(when: float) -> None:
    """Returns at `perf_counter()` time `when`, within microseconds: sleeps to just
    before it, then yields to the loop (other tasks keep running) until it is due."""
    delay = when - time.perf_counter() - _TIMER_SLACK_S
    if delay > 0:
        await asyncio.sleep(delay)
    while time.perf_counter() < when:  # noqa: ASYNC110 (a spin of at most the slack)
        await asyncio.sleep(0)


def histogram() -> HdrHistogram:
    """Microseconds from 1 us to 60 s at 3 significant digits."""
    return HdrHistogram(1, 60_000_000, 3)


def percentile_ms(hist: HdrHistogram, percentile: float) -> float:
    return float(hist.get_value_at_percentile(percentile)) / 1000.0
