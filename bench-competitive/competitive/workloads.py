"""The closed loops, written once against `Session` and `Batcher`.

Closed loop means every connection keeps exactly one request in flight: a producer
sends its next job when the previous one was confirmed, a worker reserves the next
job after it acked the last. These are sustainable-throughput figures, not behaviour
under overload, and the concurrency the broker sees is exactly the connection count.

Timers start once every connection is open and stop at the last confirmation (the
last ack, for drains), so connection setup and idle polling after the queue is empty
are not counted. Every phase records what it stored and what it delivered in a
`Ledger` for the conservation check.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from competitive import payload
from competitive.adapters.base import Batcher, Session
from competitive.conservation import Ledger

_CANCEL_GRACE_S = 10.0


class PhaseError(RuntimeError):
    """A phase missed its deadline or a connection failed; the cell is flagged."""


@dataclass(frozen=True, slots=True)
class Phase:
    """A timed phase: how many jobs it moved, in how long, and whether it was cut."""

    jobs: int
    elapsed_s: float
    budget_hit: bool = False  # an enqueue phase stopped taking jobs at its time budget
    stalled: bool = False  # a drain ended with the broker empty short of its target

    @property
    def rate(self) -> float:
        return self.jobs / self.elapsed_s if self.elapsed_s > 0 else 0.0


async def _run_all(
    coros: Sequence[Coroutine[Any, Any, None]], deadline_s: float, what: str
) -> None:
    """Runs the loops to completion; the first failure or the deadline ends them all."""
    try:
        async with asyncio.timeout(deadline_s), asyncio.TaskGroup() as group:
            for coro in coros:
                group.create_task(coro)
    except TimeoutError:
        raise PhaseError(f"{what}: not finished within {deadline_s:g}s") from None
    except ExceptionGroup as group_error:
        first = group_error.exceptions[0]
        raise PhaseError(f"{what}: {type(first).__name__}: {first}") from first


async def enqueue(
    sessions: Sequence[Session],
    jobs: int,
    size: int,
    ledger: Ledger,
    *,
    budget_s: float,
    deadline_s: float,
) -> Phase:
    """N producers share `jobs` tickets, one confirmed enqueue in flight each.

    A producer that finds the time budget spent takes no new ticket; what was
    confirmed by then is the phase's count and the drain's target.
    """
    tickets: Iterator[int] = iter(range(jobs))
    start = time.perf_counter()
    stop_taking = start + budget_s
    last = start
    cut = False

    async def produce(session: Session) -> None:
        nonlocal last, cut
        for index in tickets:  # one shared iterator: each ticket is taken once
            if time.perf_counter() > stop_taking:
                cut = True
                return
            await session.enqueue(payload.make(index, size))
            ledger.confirm(index)
            last = time.perf_counter()

    await _run_all([produce(s) for s in sessions], deadline_s, "enqueue")
    return Phase(len(ledger.confirmed), last - start, cut)


async def drain(
    sessions: Sequence[Session],
    jobs: int,
    ledger: Ledger,
    *,
    deadline_s: float,
    remaining: Callable[[], Awaitable[int]] | None = None,
    idle_s: float = 5.0,
) -> Phase:
    """N workers reserve and ack one job at a time until `jobs` acks are done.

    The timer stops at the last ack; the workers' pending reserves are then cancelled.
    A broker that delivers a job twice reaches the count early and leaves other jobs
    behind; one that lost jobs never reaches it, so when nothing was acked for `idle_s`
    and the broker itself (`remaining`) says it holds nothing, the drain ends there and
    the conservation check names what is missing instead of the run hanging.
    """
    done = asyncio.Event()
    acked = 0
    start = time.perf_counter()
    finished = start

    async def work(session: Session) -> None:
        nonlocal acked, finished
        while not done.is_set():
            delivery = await session.reserve()
            await session.ack(delivery)
            ledger.deliver(delivery.body)
            acked += 1
            finished = time.perf_counter()
            if acked >= jobs:
                done.set()

    async def watch_for_a_stall() -> None:
        assert remaining is not None
        while not done.is_set():
            await asyncio.sleep(idle_s / 4)  # a watchdog tick, not a wait for a result
            quiet = time.perf_counter() - max(finished, start)
            if quiet >= idle_s and await remaining() == 0:
                done.set()  # the broker is empty: nothing more will come

    if jobs == 0:
        return Phase(0, 0.0)
    loops = [work(s) for s in sessions]
    if remaining is not None:
        loops.append(watch_for_a_stall())
    await _until(done, loops, deadline_s, lambda: f"{acked}/{jobs} acked")
    return Phase(acked, finished - start, stalled=acked < jobs)


async def _until(
    event: asyncio.Event,
    coros: Sequence[Coroutine[Any, Any, None]],
    deadline_s: float,
    progress: Any,
) -> None:
    """Runs `coros` until `event` is set, then cancels them; failures end it early."""
    tasks = [asyncio.create_task(c) for c in coros]
    waiter = asyncio.create_task(event.wait())
    try:
        pending: set[asyncio.Task[Any]] = {waiter, *tasks}
        end = time.perf_counter() + deadline_s
        while waiter in pending:
            remaining = end - time.perf_counter()
            if remaining <= 0:
                raise PhaseError(f"drain: not finished within {deadline_s:g}s ({progress()})")
            done, pending = await asyncio.wait(
                pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done - {waiter}:
                if (exc := task.exception()) is not None:
                    raise PhaseError(f"drain: {type(exc).__name__}: {exc}") from exc
            if pending == {waiter}:
                raise PhaseError(f"drain: every worker stopped ({progress()})")
    finally:
        await _cancel(waiter, *tasks)


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    """Cancels the loops and waits for them, but not forever.

    A client that ignores cancellation must not hang the run: after the grace period
    the phase fails with a clear error (and the cell's clients are closed, which
    ends any read they are stuck in).
    """
    for task in tasks:
        task.cancel()
    _, stuck = await asyncio.wait(tasks, timeout=_CANCEL_GRACE_S)
    if stuck:
        raise PhaseError(f"{len(stuck)} client loops did not stop within {_CANCEL_GRACE_S:g}s")


async def latency(
    session: Session,
    rounds: int,
    warmup: int,
    size: int,
    ledger: Ledger,
    *,
    deadline_s: float,
) -> list[float]:
    """Sequential enqueue, reserve, ack round trips on one connection; seconds each.

    The first `warmup` rounds are done but not recorded (connection and stream setup,
    first writes).
    """
    samples: list[float] = []

    async def loop() -> None:
        for index in range(warmup + rounds):
            began = time.perf_counter()
            await session.enqueue(payload.make(index, size))
            ledger.confirm(index)
            delivery = await session.reserve()
            await session.ack(delivery)
            took = time.perf_counter() - began
            ledger.deliver(delivery.body)
            if index >= warmup:
                samples.append(took)

    await _run_all([loop()], deadline_s, "latency")
    return samples


async def lifecycle(
    producer: Session, worker: Session, jobs: int, size: int, ledger: Ledger, *, deadline_s: float
) -> Phase:
    """One producer and one worker at once, until `jobs` jobs are enqueued and acked."""
    start = time.perf_counter()
    finished = start

    async def produce() -> None:
        for index in range(jobs):
            await producer.enqueue(payload.make(index, size))
            ledger.confirm(index)

    async def work() -> None:
        nonlocal finished
        for _ in range(jobs):
            delivery = await worker.reserve()
            await worker.ack(delivery)
            ledger.deliver(delivery.body)
        finished = time.perf_counter()

    await _run_all([produce(), work()], deadline_s, "lifecycle")
    return Phase(jobs, finished - start)


async def batched_enqueue(
    batcher: Batcher, jobs: int, size: int, ledger: Ledger, *, deadline_s: float
) -> Phase:
    bodies = [payload.make(i, size) for i in range(jobs)]  # built before the timer
    start = time.perf_counter()
    await _run_all([batcher.enqueue_all(bodies, ledger.confirm)], deadline_s, "batched enqueue")
    return Phase(len(ledger.confirmed), time.perf_counter() - start)


async def batched_drain(batcher: Batcher, jobs: int, ledger: Ledger, *, deadline_s: float) -> Phase:
    start = time.perf_counter()
    await _run_all([batcher.drain(jobs, ledger.deliver)], deadline_s, "batched drain")
    return Phase(jobs, time.perf_counter() - start)
