"""An in-process broker on in-memory storage and a manual clock, for fast core tests.

These are the seams the core is built around (`fila.storage.backend.Storage`,
`fila.clock.Clock`), not mocks: the same `Broker`, `Committer`, DRR, leases and
timers run as in `fila-server`; only the disk and the passage of time are replaced,
so a test can move time by an hour in a microsecond and count storage writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fila.clock import ManualClock
from fila.config import Config
from fila.core import retry
from fila.core.broker import Broker, BrokerSettings
from fila.core.consumers import Consumer
from fila.core.recovery import RecoveryReport
from fila.storage.backend import MemoryStorage
from fila.storage.committer import Committer
from fila.v1 import service_pb2


@dataclass
class CoreBroker:
    broker: Broker
    storage: MemoryStorage
    clock: ManualClock
    committer: Committer
    random: Callable[[], float]

    async def settle(self) -> None:
        """Lets every pending commit, after-commit callback and pump run."""
        for _ in range(3):
            await self.committer.flushed()
            await asyncio.sleep(0)  # yield: after-commit callbacks and the pump are call_soon

    async def advance(self, ms: int) -> None:
        """Moves time and runs every timer that fell due, then settles."""
        self.clock.advance(ms)
        self.broker.timers.run_due()
        await self.settle()

    async def enqueue(
        self, queue: str, count: int = 1, *, headers: dict[str, str] | None = None, **kw: int
    ) -> list[str]:
        requests = [
            service_pb2.EnqueueRequest(queue=queue, payload=b"%d" % i, headers=headers or {}, **kw)
            for i in range(count)
        ]
        results, committed = self.broker.enqueue(requests)
        await committed
        await self.settle()
        return [r for r in results if isinstance(r, str)]

    def take(self, consumer: Consumer) -> list[str]:
        """What the consumer's stream would send now (leases recorded), as message ids."""
        from fila.v1 import service_pb2 as s

        ids: list[str] = []
        broker = self.broker
        while (frame := broker.sending(consumer, consumer.max_batch)) is not None:
            broker.sent(consumer)  # written at once: the client reads
            response = s.ConsumeResponse.FromString(frame)
            ids += [m.id for m in response.messages] or [response.message.id]
        return ids


def make_core(
    *,
    persist_mode: str = "buffer",
    config: Config | None = None,
    queues: Sequence[str] = (),
    random: Callable[[], float] = lambda: 0.5,
) -> CoreBroker:
    """A broker over memory; call inside a running event loop. `queues` are created
    with no attempt limit and immediate retries (the retry policy of queues created
    before it existed), so tests of other concerns see a nack come back at once;
    `random` is the retry jitter's draw (0.5: no jitter)."""
    storage = MemoryStorage()
    clock = ManualClock()
    committer = Committer(storage, persist_mode, lambda exc: None)  # type: ignore[arg-type]
    broker = Broker(
        storage,
        committer,
        BrokerSettings.from_config(config or Config()),
        clock,
        loop_driven_timers=False,
        random=random,
    )
    for name in queues:
        broker.create_queue(
            name, "", "", 1000, max_attempts=retry.UNLIMITED, retry_backoff=retry.NONE
        )
    return CoreBroker(broker, storage, clock, committer, random)


def restarted(core: CoreBroker, config: Config | None = None) -> tuple[CoreBroker, RecoveryReport]:
    """A new broker over the same storage and clock, rebuilt by recovery (a restart).
    Leases whose deadline passed while it was down expire on the timers' first run,
    as in fila-server: call `settle()` before looking at what they became."""
    core.committer.flush_now()
    committer = Committer(core.storage, "buffer", lambda exc: None)  # type: ignore[arg-type]
    broker = Broker(
        core.storage,
        committer,
        BrokerSettings.from_config(config or Config()),
        core.clock,
        loop_driven_timers=False,
        random=core.random,
    )
    report = broker.recover()
    broker.timers.run_due()
    return CoreBroker(broker, core.storage, core.clock, committer, core.random), report
