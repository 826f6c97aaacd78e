"""The cells of a run: each opens its clients, runs one workload, checks conservation.

A cell owns a fresh queue per repetition, closes every client it opened whatever
happens, and returns one `Measurement` per row it feeds. A cell that raises is turned
into measurements that carry the error, so a failure shows up in its rows instead of
ending the run or disappearing.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from competitive import conservation, netstat, workloads
from competitive.adapters.base import BatchingUnavailable, BrokerAdapter, Session
from competitive.conservation import Ledger
from competitive.model import MS, NOT_AVAILABLE, RATE, Batching, CellKey, Measurement, Mode
from competitive.profile import Profile
from competitive.stats import latency_percentiles_ms

CLIENT_BOUND_SHARE = 0.85  # load generator CPU / wall time above which a row says so
_CLOSE_TIMEOUT_S = 15.0


@dataclass(frozen=True, slots=True)
class Outcome:
    measurements: list[Measurement]
    jobs: int  # jobs enqueued (and consumed) by the cell, for CPU per message


class ClientClock:
    """Wall time and the load generator's own CPU time over a timed phase."""

    def __init__(self) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.process_time()

    def note(self) -> str:
        wall = time.perf_counter() - self._wall
        cpu = time.process_time() - self._cpu
        if wall > 0 and cpu / wall >= CLIENT_BOUND_SHARE:
            return f"load generator at {100 * cpu / wall:.0f}% of its CPU (client-bound)"
        return ""


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


@contextlib.asynccontextmanager
async def sessions(adapter: BrokerAdapter, queue: str, count: int) -> AsyncIterator[list[Session]]:
    """`count` open sessions, all closed on exit (each close bounded in time)."""
    opened: list[Session] = []
    try:
        for _ in range(count):
            opened.append(await adapter.open_session(queue))
        yield opened
    finally:
        await _close_all(opened)


class _Closable(Protocol):
    async def close(self) -> None: ...


async def _close_all(closables: Sequence[_Closable]) -> None:
    async def close(s: _Closable) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(s.close(), _CLOSE_TIMEOUT_S)

    await asyncio.gather(*(close(s) for s in closables))


class Cell(abc.ABC):
    """One workload at one setting; `keys` are the rows it feeds, whatever happens."""

    batching: Batching = "none"

    def __init__(self, profile: Profile) -> None:
        self.profile = profile

    @property
    @abc.abstractmethod
    def label(self) -> str:
        """A short name, used for queue names and progress."""

    @abc.abstractmethod
    def keys(self, broker: str, mode: Mode) -> list[tuple[CellKey, str]]:
        """(row key, unit) for every row this cell produces."""

    @abc.abstractmethod
    async def measure(self, adapter: BrokerAdapter, queue: str) -> Outcome: ...

    async def run(self, adapter: BrokerAdapter, rep: int) -> Outcome:
        queue = f"q_{self.label}_{rep}"
        note = adapter.mode_note(adapter.mode)
        try:
            await adapter.create_queue(queue)
            try:
                outcome = await self.measure(adapter, queue)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(adapter.delete_queue(queue), _CLOSE_TIMEOUT_S)
        except BatchingUnavailable as exc:
            return self._all(adapter, f"{NOT_AVAILABLE}: {exc}", note)
        except Exception as exc:
            return self._all(adapter, f"error: {type(exc).__name__}: {exc}", note)
        if note:
            outcome = Outcome(
                [
                    Measurement(m.key, m.value, m.unit, m.status, _join(note, m.note))
                    for m in outcome.measurements
                ],
                outcome.jobs,
            )
        return outcome

    def _all(self, adapter: BrokerAdapter, status: str, note: str) -> Outcome:
        rows = self.keys(adapter.name, adapter.mode)
        return Outcome([Measurement(k, None, unit, status, note) for k, unit in rows], 0)

    def key(self, broker: str, mode: Mode, workload: str, connections: int, size: int) -> CellKey:
        return CellKey(broker, mode, self.batching, workload, connections, size)


async def _finish(adapter: BrokerAdapter, queue: str, ledger: Ledger, expected: int) -> str:
    remaining = await adapter.remaining(queue)
    return conservation.check(ledger, remaining=remaining, expected=expected)


class Matrix(Cell):
    """Enqueue then drain with N connections, one 256-byte job in flight each."""

    def __init__(self, profile: Profile, connections: int, jobs: int, size: int) -> None:
        super().__init__(profile)
        self.connections = connections
        self.jobs = jobs
        self.size = size

    @property
    def label(self) -> str:
        return f"c{self.connections}_b{self.size}"

    def keys(self, broker: str, mode: Mode) -> list[tuple[CellKey, str]]:
        return [
            (self.key(broker, mode, w, self.connections, self.size), RATE)
            for w in ("enqueue", "drain")
        ]

    async def measure(self, adapter: BrokerAdapter, queue: str) -> Outcome:
        p = self.profile
        ledger = Ledger(self.size)
        async with sessions(adapter, queue, self.connections) as opened:
            clock = ClientClock()
            enq = await workloads.enqueue(
                opened, self.jobs, self.size, ledger, budget_s=p.phase_budget_s,
                deadline_s=p.deadline_s,
            )  # fmt: skip
            enq_note = clock.note()
            seen = netstat.established_to(adapter.port)
            clock = ClientClock()
            drn = await workloads.drain(
                opened, enq.jobs, ledger, deadline_s=p.deadline_s,
                remaining=lambda: adapter.remaining(queue), idle_s=p.idle_s,
            )  # fmt: skip
            drain_note = clock.note()
        status = await _finish(adapter, queue, ledger, enq.jobs)
        shared = ""
        if seen != self.connections:
            shared = f"{self.connections} clients over {seen} TCP connection(s)"
        cut = f"time budget reached: {enq.jobs} of {self.jobs} jobs" if enq.budget_hit else ""
        (ek, _), (dk, _) = self.keys(adapter.name, adapter.mode)
        return Outcome(
            [
                Measurement(ek, enq.rate, RATE, status, _join(shared, cut, enq_note)),
                Measurement(dk, drn.rate, RATE, status, _join(shared, cut, drain_note)),
            ],
            enq.jobs,
        )


class Latency(Cell):
    """One connection, sequential enqueue-reserve-ack round trips: p50, p99, p999."""

    PERCENTILES = (("latency_p50", 50.0), ("latency_p99", 99.0), ("latency_p999", 99.9))

    @property
    def label(self) -> str:
        return "latency"

    def keys(self, broker: str, mode: Mode) -> list[tuple[CellKey, str]]:
        return [
            (self.key(broker, mode, w, 1, self.profile.job_bytes), MS) for w, _ in self.PERCENTILES
        ]

    async def measure(self, adapter: BrokerAdapter, queue: str) -> Outcome:
        p = self.profile
        ledger = Ledger(p.job_bytes)
        async with sessions(adapter, queue, 1) as (session,):
            samples = await workloads.latency(
                session, p.latency_rounds, p.latency_warmup, p.job_bytes, ledger,
                deadline_s=p.deadline_s,
            )  # fmt: skip
        rounds = p.latency_rounds + p.latency_warmup
        status = await _finish(adapter, queue, ledger, rounds)
        values = latency_percentiles_ms(samples, [q for _, q in self.PERCENTILES])
        note = f"{len(samples)} round trips"
        return Outcome(
            [
                Measurement(key, value, unit, status, note)
                for (key, unit), value in zip(
                    self.keys(adapter.name, adapter.mode), values, strict=True
                )
            ],
            rounds,
        )


class Batched(Cell):
    """One producer with the client's own batching, then one consumer likewise."""

    batching: Batching = "native"

    def __init__(self, profile: Profile, jobs: int) -> None:
        super().__init__(profile)
        self.jobs = jobs

    @property
    def label(self) -> str:
        return "batched"

    def keys(self, broker: str, mode: Mode) -> list[tuple[CellKey, str]]:
        size = self.profile.job_bytes
        return [(self.key(broker, mode, w, 1, size), RATE) for w in ("enqueue", "drain")]

    async def measure(self, adapter: BrokerAdapter, queue: str) -> Outcome:
        p = self.profile
        ledger = Ledger(p.job_bytes)
        producer = await adapter.open_batcher(queue)
        try:
            clock = ClientClock()
            enq = await workloads.batched_enqueue(
                producer, self.jobs, p.job_bytes, ledger, deadline_s=p.deadline_s
            )
            enq_note = clock.note()
        finally:
            await _close_all([producer])
        consumer = await adapter.open_batcher(queue)
        try:
            clock = ClientClock()
            drn = await workloads.batched_drain(consumer, enq.jobs, ledger, deadline_s=p.deadline_s)
            drain_note = clock.note()
        finally:
            await _close_all([consumer])
        status = await _finish(adapter, queue, ledger, self.jobs)
        (ek, _), (dk, _) = self.keys(adapter.name, adapter.mode)
        return Outcome(
            [
                Measurement(ek, enq.rate, RATE, status, enq_note),
                Measurement(dk, drn.rate, RATE, status, drain_note),
            ],
            enq.jobs,
        )


class Lifecycle(Cell):
    """A producer and a worker at once: enqueue, consume and ack of 1 KB jobs."""

    @property
    def label(self) -> str:
        return "lifecycle"

    def keys(self, broker: str, mode: Mode) -> list[tuple[CellKey, str]]:
        return [(self.key(broker, mode, "lifecycle", 2, self.profile.extras_payload), RATE)]

    async def measure(self, adapter: BrokerAdapter, queue: str) -> Outcome:
        p = self.profile
        ledger = Ledger(p.extras_payload)
        async with sessions(adapter, queue, 2) as (producer, worker):
            clock = ClientClock()
            phase = await workloads.lifecycle(
                producer, worker, p.lifecycle_jobs, p.extras_payload, ledger,
                deadline_s=p.deadline_s,
            )  # fmt: skip
            note = clock.note()
        status = await _finish(adapter, queue, ledger, p.lifecycle_jobs)
        ((key, unit),) = self.keys(adapter.name, adapter.mode)
        return Outcome([Measurement(key, phase.rate, unit, status, note)], phase.jobs)


class MultiProducer(Cell):
    """Three producers at once (1 KB jobs); drained afterwards for the check only."""

    @property
    def label(self) -> str:
        return "multi"

    def keys(self, broker: str, mode: Mode) -> list[tuple[CellKey, str]]:
        p = self.profile
        return [(self.key(broker, mode, "multi_producer", p.producers, p.extras_payload), RATE)]

    async def measure(self, adapter: BrokerAdapter, queue: str) -> Outcome:
        p = self.profile
        ledger = Ledger(p.extras_payload)
        async with sessions(adapter, queue, p.producers) as opened:
            clock = ClientClock()
            enq = await workloads.enqueue(
                opened, p.multi_producer_jobs, p.extras_payload, ledger,
                budget_s=p.phase_budget_s, deadline_s=p.deadline_s,
            )  # fmt: skip
            note = clock.note()
            await workloads.drain(
                opened, enq.jobs, ledger, deadline_s=p.deadline_s,
                remaining=lambda: adapter.remaining(queue), idle_s=p.idle_s,
            )  # fmt: skip
        status = await _finish(adapter, queue, ledger, enq.jobs)
        cut = (
            f"time budget reached: {enq.jobs} of {p.multi_producer_jobs}" if enq.budget_hit else ""
        )
        ((key, unit),) = self.keys(adapter.name, adapter.mode)
        return Outcome([Measurement(key, enq.rate, unit, status, _join(cut, note))], enq.jobs)


def plan(profile: Profile) -> list[Cell]:
    """Every cell of a run, in the order each repetition runs them."""
    cells: list[Cell] = [
        Matrix(profile, n, jobs, profile.job_bytes)
        for n, jobs in sorted(profile.jobs_by_connections.items())
    ]
    cells.append(Latency(profile))
    cells.append(Batched(profile, profile.batched_jobs))
    cells += [Matrix(profile, 1, profile.payload_jobs, size) for size in profile.payload_sizes]
    if profile.lifecycle_jobs:
        cells.append(Lifecycle(profile))
    if profile.multi_producer_jobs:
        cells.append(MultiProducer(profile))
    return cells
