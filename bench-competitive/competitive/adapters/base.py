"""The small interface every broker adapter implements.

The workloads only ever see a `Session` (one client connection keeping one request in
flight: enqueue, reserve, ack) and a `Batcher` (one connection using the client's own
batching for a whole phase). A `BrokerAdapter` is one broker in one durability mode:
it knows how to start the server (command line, configuration, readiness probe, stop),
how to make and remove a queue, how to open those two kinds of client, and how many
jobs the broker itself still holds, which the conservation check needs.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

from competitive.model import Mode
from competitive.procs import BrokerProcess, LaunchSpec, free_port


def raise_if_cancelled() -> None:
    """For polling loops around client calls that may swallow a cancellation.

    On Python 3.11 a cancellation that lands while a client's own read timeout fires
    can come out as that timeout (redis-py then returns None from BLMOVE), and a
    polling loop would go on forever in a task that is already being cancelled.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@dataclass(frozen=True, slots=True)
class Delivery:
    """A reserved job: its payload and whatever the broker needs to ack it."""

    body: bytes
    handle: object


class Session(Protocol):
    """One client connection with at most one request in flight."""

    async def enqueue(self, body: bytes) -> None:
        """Returns once the broker confirmed the job is stored (per the mode)."""

    async def reserve(self) -> Delivery:
        """Waits for the next job; the harness cancels it when the phase is over."""

    async def ack(self, delivery: Delivery) -> None:
        """Settles a job so the broker deletes it."""

    async def close(self) -> None: ...


class Batcher(Protocol):
    """One connection using the client library's own batching, one phase at a time."""

    async def enqueue_all(self, bodies: Sequence[bytes], confirmed: Callable[[int], None]) -> None:
        """Stores every body; calls `confirmed(i)` once body i is confirmed."""

    async def drain(self, count: int, delivered: Callable[[bytes], None]) -> None:
        """Consumes and acks `count` jobs; returns when the last ack is settled."""

    async def close(self) -> None: ...


class BatchingUnavailable(Exception):
    """This broker (or this installed client) has no batching to measure; says why."""


class BrokerAdapter(abc.ABC):
    """A broker in one mode: start, queues, clients, stop."""

    name: ClassVar[str]  # as on the command line: fila, redis, nats, rabbitmq, beanstalkd
    title: ClassVar[str]  # as in tables
    client_library: ClassVar[str]
    start_timeout_s: ClassVar[float] = 30.0

    def __init__(self, mode: Mode, workdir: Path, *, cpu: int | None, instance: str) -> None:
        self.mode = mode
        self.workdir = workdir
        self.cpu = cpu
        self.instance = instance
        self.port = free_port()  # the port clients connect to
        self.process: BrokerProcess | None = None

    # What the reports say about this broker.

    @classmethod
    @abc.abstractmethod
    def missing(cls) -> str | None:
        """Why the broker cannot run here (not installed), or None."""

    @classmethod
    @abc.abstractmethod
    def version(cls) -> str: ...

    @classmethod
    @abc.abstractmethod
    def settings(cls, mode: Mode) -> str:
        """The durability settings of `mode`, one line, as METHODOLOGY.md explains them."""

    @classmethod
    def mode_note(cls, mode: Mode) -> str:
        """A caveat attached to every row of `mode` (e.g. no fsync available), or ''."""
        return ""

    @classmethod
    @abc.abstractmethod
    def batching(cls) -> str:
        """What the batched rows use, or why there are none."""

    # Server lifecycle.

    @abc.abstractmethod
    def launch_spec(self) -> LaunchSpec:
        """Writes any configuration under `workdir` and returns the command to run."""

    @abc.abstractmethod
    async def probe(self) -> bool:
        """One bounded readiness check: a real protocol round trip."""

    async def start(self) -> float:
        """Starts the server and waits until it serves; returns the seconds it took."""
        self.process = BrokerProcess(
            self.name, self.launch_spec(), cpu=self.cpu, instance=self.instance
        )
        self.process.start()
        return await self.process.wait_ready(self.probe, self.start_timeout_s, "readiness")

    async def stop(self) -> None:
        """Graceful stop with a deadline, then SIGKILL of anything left; never raises."""
        if self.process is not None:
            await asyncio.to_thread(self.process.terminate)

    # Queues and clients.

    @abc.abstractmethod
    async def create_queue(self, queue: str) -> None: ...

    @abc.abstractmethod
    async def delete_queue(self, queue: str) -> None: ...

    @abc.abstractmethod
    async def open_session(self, queue: str) -> Session: ...

    @abc.abstractmethod
    async def open_batcher(self, queue: str) -> Batcher:
        """Raises `BatchingUnavailable` when there is no batching to measure."""

    @abc.abstractmethod
    async def remaining(self, queue: str) -> int:
        """Jobs the broker still holds in `queue`: ready plus unacknowledged."""
