"""An in-process broker on in-memory storage and a manual clock, for fast core tests.

These are the seams the core is built around (`fila.storage.backend.Storage`,
`fila.clock.Clock`), not mocks: the same `Broker`, `Committer`, DRR, leases and
timers run as in `fila-server`; only the disk and the passage of time are replaced,
so a test can move time by an hour in a microsecond and count storage writes.

Tests drive the core only through `CoreBroker`'s methods, each the call the gRPC edge
makes (or what a test must look at) in a line or two: when the core's insides move,
this file is the one that follows them. Methods that change state wait for the
commit and let every after-commit callback and pump run (`settle`), as a client
does when it waits for its answer.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ParamSpec

from fila.clock import ManualClock  # re-exported: unit tests of the core's parts
from fila.config import Config, parse_config
from fila.core import retry
from fila.core.broker import Broker, BrokerSettings, ItemResult
from fila.core.consumers import Consumer
from fila.core.errors import BrokerError
from fila.core.recovery import RecoveryReport
from fila.core.stats import QueueStats
from fila.lua.hooks import HookCounters
from fila.storage import keys
from fila.storage.backend import MemoryStorage
from fila.storage.committer import Committer
from fila.v1 import messages_pb2, service_pb2

P = ParamSpec("P")


def run_async(test: Callable[P, Awaitable[None]]) -> Callable[P, None]:
    """An `async def` test run to its end on a fresh event loop (the core's commits and
    pumps need a running loop); parametrize and Hypothesis see its signature."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        asyncio.run(test(*args, **kwargs))  # type: ignore[arg-type]

    return run


@dataclass
class CoreBroker:
    broker: Broker
    storage: MemoryStorage
    clock: ManualClock
    committer: Committer
    random: Callable[[], float]

    # -- time and the loop ---------------------------------------------------------

    async def settle(self) -> None:
        """Lets every pending commit, after-commit callback and pump run."""
        for _ in range(3):
            await self.committer.flushed()
            await asyncio.sleep(0)  # yield: after-commit callbacks and the pump are call_soon

    async def advance(self, ms: int) -> None:
        """Moves time and runs every timer that fell due, then settles. A timer callback
        that raises fails the test: the timers would log it and carry on, hiding it."""
        timers = self.broker.timers
        failures = timers.failures
        self.clock.advance(ms)
        timers.run_due()
        assert timers.failures == failures, "a timer callback failed (see the log)"
        await self.settle()

    def now_ms(self) -> int:
        return self.clock.now_ms()

    # -- queues and config ---------------------------------------------------------

    async def create_queue(
        self,
        name: str,
        *,
        on_enqueue: str = "",
        on_failure: str = "",
        visibility_timeout_ms: int = 0,
        max_attempts: int = retry.UNLIMITED,
        retry_backoff: str = retry.NONE,
    ) -> None:
        """CreateQueue; unless told otherwise with no attempt limit and immediate retries
        (as `make_core`'s queues), so a nack without a hook comes back at once."""
        await self.broker.create_queue(
            name,
            on_enqueue,
            on_failure,
            visibility_timeout_ms,
            max_attempts=max_attempts,
            retry_backoff=retry_backoff,
        )

    async def delete_queue(self, name: str) -> None:
        await self.broker.delete_queue(name)
        await self.settle()

    def queue_names(self) -> list[str]:
        return [queue.name for queue in self.broker.list_queues()]

    async def set_config(self, key: str, value: str) -> None:
        await self.broker.set_config(key, value)
        await self.settle()

    def get_config(self, key: str) -> str:
        return self.broker.get_config(key)

    # -- enqueue -------------------------------------------------------------------

    async def enqueue(
        self, queue: str, count: int = 1, *, headers: dict[str, str] | None = None, **kw: int
    ) -> list[str]:
        requests = [
            service_pb2.EnqueueRequest(queue=queue, payload=b"%d" % i, headers=headers or {}, **kw)
            for i in range(count)
        ]
        return [r for r in await self.enqueue_requests(requests) if isinstance(r, str)]

    async def enqueue_each(self, queue: str, headers: Sequence[Mapping[str, str]]) -> list[str]:
        """One message per entry of `headers`, in one batch; their ids in that order."""
        requests = [service_pb2.EnqueueRequest(queue=queue, headers=h) for h in headers]
        results = await self.enqueue_requests(requests)
        assert all(isinstance(r, str) for r in results), results
        return [str(r) for r in results]

    async def enqueue_requests(
        self, requests: Sequence[service_pb2.EnqueueRequest]
    ) -> list[ItemResult]:
        """A batch as EnqueueBatch sends it: each item's id, or the error it ended with."""
        results, committed = self.start_enqueue(requests)
        await committed
        await self.settle()
        return results

    def start_enqueue(
        self, requests: Sequence[service_pb2.EnqueueRequest]
    ) -> tuple[list[ItemResult], asyncio.Future[None]]:
        """A batch handed to the core: its results, and the future the answer waits on."""
        return self.broker.enqueue(requests)

    # -- consumers -----------------------------------------------------------------

    async def attach(
        self, queue: str, *, prefetch: int = 0, max_batch: int = 0, stream: bool = False
    ) -> Consumer:
        """A consumer as a Consume stream opens one (`stream`: a StreamConsume stream,
        which settles its own deliveries); the pump has run for it."""
        consumer = self.broker.attach_consumer(
            queue, prefetch=prefetch, max_batch=max_batch, owns_settlement=stream
        )
        await self.settle()
        return consumer

    async def detach(self, consumer: Consumer) -> None:
        """The consumer's stream ended (the client went away or cancelled)."""
        self.broker.detach_consumer(consumer)
        await self.settle()

    async def end_streams(self, reason: BrokerError) -> None:
        """Every consume stream ends with `reason`, as at shutdown (`Broker.close`)."""
        self.broker.end_consumers(reason)
        await self.settle()

    def receive(self, consumer: Consumer) -> list[messages_pb2.Message]:
        """What the consumer's stream would send now (leases recorded), frame by frame,
        each frame written at once (the client reads)."""
        messages: list[messages_pb2.Message] = []
        while (frame := self.sending(consumer)) is not None:
            self.sent(consumer)
            response = service_pb2.ConsumeResponse.FromString(frame)
            messages += list(response.messages) or [response.message]
        return messages

    def take(self, consumer: Consumer) -> list[str]:
        """`receive`, as message ids."""
        return [m.id for m in self.receive(consumer)]

    def sending(self, consumer: Consumer, limit: int = 0) -> bytes | None:
        """The next frame handed to gRPC (up to `limit`, else the stream's max_batch),
        not yet written: its messages are sent, its bytes still held (see `sent`)."""
        return self.broker.sending(consumer, limit or consumer.max_batch)

    def sent(self, consumer: Consumer) -> None:
        """gRPC wrote the frame `sending` returned."""
        self.broker.sent(consumer)

    def unsettled(self, consumer: Consumer) -> int:
        """Leases the consumer holds (buffered or sent, not yet settled)."""
        return consumer.unsettled

    def held(self, consumer: Consumer) -> tuple[int, int]:
        """(bytes buffered for the stream, those plus the frame gRPC is writing)."""
        return consumer.buffered_bytes, consumer.held_bytes

    def budget(self) -> tuple[int, bool]:
        """The broker-wide buffer budget: (bytes held for streams, whether it is spent)."""
        return self.broker.buffers.bytes, self.broker.buffers.exhausted

    # -- settlement ----------------------------------------------------------------

    async def ack(self, queue: str, *message_ids: str) -> list[BrokerError | None]:
        results, committed = self.broker.ack([(queue, m) for m in message_ids])
        await committed
        await self.settle()
        return results

    async def nack(
        self, queue: str, *message_ids: str, error: str = "failed"
    ) -> list[BrokerError | None]:
        results, committed = self.broker.nack([(queue, m, error) for m in message_ids])
        await committed
        await self.settle()
        return results

    async def extend(self, queue: str, message_id: str, extend_ms: int) -> int:
        """ExtendLease; the new deadline."""
        deadline, committed = self.broker.extend_lease(queue, message_id, extend_ms)
        await committed
        return deadline

    async def settle_on_stream(
        self,
        consumer: Consumer,
        acks: Sequence[str] = (),
        nacks: Sequence[tuple[str, str]] = (),
    ) -> None:
        """Acks and nacks sent on a StreamConsume stream (raises as the core does)."""
        self.broker.settle_on_stream(consumer.id, consumer.queue_name, acks, nacks)
        await self.settle()

    # -- what a client or an operator can see ---------------------------------------

    def stats(self, queue: str) -> QueueStats:
        return self.broker.stats(queue)

    def depth(self, queue: str) -> tuple[int, int]:
        """(depth, in_flight) as GetStats reports them."""
        stats = self.stats(queue)
        return stats.depth, stats.in_flight

    def peek(
        self, queue: str, limit: int = 1000, after_id: str = "", fairness_key: str = ""
    ) -> tuple[list[messages_pb2.Message], str]:
        """A page, at once. Peek is a coroutine because over many fairness keys it takes
        several loop turns (`PEEK_KEYS_PER_TURN` keys each); over fewer it finishes in
        its first step, which is all this runs (tests of bigger queues await
        `broker.peek`)."""
        step = self.broker.peek(queue, limit, after_id, fairness_key)
        try:
            step.send(None)
        except StopIteration as finished:
            page: tuple[list[messages_pb2.Message], str] = finished.value
            return page
        step.close()
        raise AssertionError(f"peek of {queue!r} needs more than one turn: await broker.peek")

    def attempts(self, queue: str) -> dict[str, int]:
        """Every message of `queue` (ready, delayed or leased) and its attempt count."""
        return {m.id: m.metadata.attempt_count for m in self.peek(queue)[0]}

    async def redrive(self, dlq: str, count: int = 0) -> int:
        moved = await self.broker.redrive(dlq, count)
        await self.settle()
        return moved

    async def purge(self, queue: str) -> int:
        count, committed = self.broker.purge(queue)
        await committed
        await self.settle()
        return count

    def hook_counters(self, queue: str) -> dict[str, HookCounters]:
        """The queue's hook outcome counts, by hook name (empty without hooks)."""
        hooks = self.broker.get_queue(queue).hooks
        return hooks.counters() if hooks is not None else {}

    # -- inside views (what stats do not show) ----------------------------------------

    def delayed(self, queue: str) -> int:
        """Messages of `queue` waiting for their due time."""
        return len(self.broker.get_queue(queue).delayed)

    def lease_deadlines(self, queue: str) -> dict[str, int]:
        """Each leased message's id and its deadline (ms on the broker's clock)."""
        return {lease.ref.id: lease.deadline_ms for lease in self.broker.get_queue(queue).leases}

    def throttle_wakes(self, queue: str) -> int:
        """Parked fairness keys of `queue` with a wake-up scheduled."""
        return len(self.broker.get_queue(queue).throttle_wakes)

    def latency_samples(self, queue: str) -> int:
        """First deliveries recorded in the queue's enqueue-to-delivery histogram."""
        return sum(self.broker.get_queue(queue).latency.counts)

    def stored(self, prefix: bytes) -> list[bytes]:
        """The storage keys under `prefix` (e.g. `keys.LEASE`), committed or not."""
        self.committer.flush_now()
        return [key for key, _ in self.storage.scan(prefix)]

    def stored_message(self, message_id: str) -> bytes | None:
        """The committed record of a message, or None."""
        return self.storage.get(keys.MESSAGE + bytes.fromhex(message_id.replace("-", "")))


def config(toml: str) -> Config:
    """A broker configuration from TOML text (checked as fila-server checks its file)."""
    return parse_config(toml, "test")


def make_core(
    *,
    persist_mode: str = "buffer",
    config: Config | None = None,
    queues: Sequence[str] = (),
    random: Callable[[], float] = lambda: 0.5,
) -> CoreBroker:
    """A broker over memory; call inside a running event loop. `queues` are created
    with a visibility timeout of 1000 ms, no attempt limit and immediate retries (the
    retry policy of queues created before it existed), so tests of other concerns see a
    nack come back at once; `random` is the retry jitter's draw (0.5: no jitter).
    The committer keeps message records for delivery as fila-server's default does."""
    storage = MemoryStorage()
    clock = ManualClock()
    committer = _committer(storage, persist_mode, config)
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


def _committer(storage: MemoryStorage, persist_mode: str, config: Config | None) -> Committer:
    return Committer(
        storage,
        persist_mode,  # type: ignore[arg-type]
        lambda exc: None,
        recent_bytes=(config or Config()).storage.recent_records_bytes,
    )


def restarted(core: CoreBroker, config: Config | None = None) -> tuple[CoreBroker, RecoveryReport]:
    """A new broker over the same storage and clock, rebuilt by recovery (a restart).

    What was committed survives; what the old broker held only in memory does not
    (its consumers, its token buckets' levels). Leases whose deadline passed while it
    was down expire on the timers' first run, as in fila-server: call `settle()` before
    looking at what they became."""
    core.committer.flush_now()
    committer = _committer(core.storage, "buffer", config)
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
