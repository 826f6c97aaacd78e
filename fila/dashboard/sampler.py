"""One task samples the broker on a fixed interval; every page reads its latest picture.

Pages never call `ListQueues`/`GetStats` themselves: with live refresh every open
tab would otherwise multiply the load on the broker, and rates need evenly spaced
samples anyway. The sampler is the single owner of what the dashboard knows about
the broker (its queue histories and whether it is reachable); request handlers
only read it, or ask for a fresh sample after an action (`sample()`), which is
coalesced with any sample already under way.

A failed sample does not throw away history: the pages keep showing the last
picture under a "broker unreachable" banner, and the next successful sample clears
the banner by itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from fila.dashboard.broker import Broker, BrokerError
from fila.dashboard.history import (
    Counters,
    KeyStat,
    QueueHistory,
    QueueSample,
    ThrottleStat,
)
from fila.v1 import admin_pb2

log = logging.getLogger("fila.dashboard")

# GetStats calls in flight at once: enough to sample hundreds of queues within an
# interval without flooding the broker's event loop with one burst.
_STATS_CONCURRENCY: Final = 8


@dataclass(frozen=True, slots=True)
class BrokerStatus:
    """`ok` when the last sample succeeded; else `error` is the broker's (or gRPC's) reason,
    and `reachable` tells a broker that refused the dashboard from one that is down."""

    ok: bool
    reachable: bool = False
    error: str = ""
    checked_at: float = 0.0
    last_ok_at: float | None = None
    node_count: int = 0


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The outcome of the latest sample; `queues` are the names the broker listed."""

    status: BrokerStatus
    queues: tuple[str, ...] = ()
    taken_at: float = 0.0
    sampled: bool = field(default=False)


class Sampler:
    def __init__(
        self,
        broker: Broker,
        *,
        interval: float,
        retention: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.broker = broker
        self.interval = interval
        self.retention = retention
        self._clock = clock
        self.histories: dict[str, QueueHistory] = {}
        self.snapshot = Snapshot(BrokerStatus(ok=False, error="not sampled yet"))
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        """Sample forever, every `interval` seconds; cancelled by the app's lifespan.

        Broker failures are expected and become the banner (see `_take`). Anything else
        is a bug: it is logged with its traceback and shown in the banner, and sampling
        goes on, because a monitor that silently stops would show stale numbers as live.
        """
        while True:
            started = self._clock()
            try:
                await self.sample()
            except Exception as exc:  # logged and shown: see the docstring
                log.exception("sampling the broker failed")
                self.snapshot = Snapshot(
                    BrokerStatus(ok=False, reachable=True, error=f"dashboard error: {exc!r}"),
                    self.snapshot.queues,
                    self._clock(),
                    sampled=True,
                )
            await asyncio.sleep(max(0.0, self.interval - (self._clock() - started)))

    async def sample(self) -> Snapshot:
        """Take a sample now, unless one finished after this call began (then reuse it)."""
        asked_at = self._clock()
        async with self._lock:
            if self.snapshot.sampled and self.snapshot.taken_at >= asked_at:
                return self.snapshot
            self.snapshot = await self._take()
            return self.snapshot

    def history(self, queue: str) -> QueueHistory | None:
        return self.histories.get(queue)

    async def _take(self) -> Snapshot:
        now = self._clock()
        previous = self.snapshot.status
        try:
            listing = await self.broker.list_queues()
            infos = sorted(listing.queues, key=lambda q: q.name)
            samples = await self._stats_for(infos, now)
        except BrokerError as err:
            if previous.ok:
                log.warning("broker sample failed: %s", err.message)
            status = BrokerStatus(
                ok=False,
                reachable=not err.unreachable,
                error=err.message,
                checked_at=now,
                last_ok_at=previous.last_ok_at,
                node_count=previous.node_count,
            )
            return Snapshot(status, self.snapshot.queues, now, sampled=True)
        for name in set(self.histories) - {q.name for q in infos}:
            del self.histories[name]  # deleted queue
        for info, sample in zip(infos, samples, strict=True):
            self.histories.setdefault(info.name, QueueHistory(self.retention)).add(sample)
        status = BrokerStatus(
            ok=True,
            reachable=True,
            checked_at=now,
            last_ok_at=now,
            node_count=listing.cluster_node_count,
        )
        return Snapshot(status, tuple(q.name for q in infos), now, sampled=True)

    async def _stats_for(self, infos: list[admin_pb2.QueueInfo], now: float) -> list[QueueSample]:
        gate = asyncio.Semaphore(_STATS_CONCURRENCY)

        async def one(info: admin_pb2.QueueInfo) -> QueueSample | BrokerError:
            async with gate:
                try:
                    stats = await self.broker.get_stats(info.name)
                except BrokerError as err:
                    if err.unreachable:
                        return err  # the whole sample fails: raised below, once
                    # Denied by an ACL, or deleted since ListQueues: keep what the list said.
                    return _listed_only(info, now, err.message)
            return _from_stats(info, stats, now)

        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(info)) for info in infos]
        results = [task.result() for task in tasks]
        for result in results:
            if isinstance(result, BrokerError):
                raise result
        return [r for r in results if isinstance(r, QueueSample)]


def _listed_only(info: admin_pb2.QueueInfo, now: float, error: str) -> QueueSample:
    return QueueSample(
        at=now,
        depth=info.depth,
        in_flight=info.in_flight,
        consumers=info.active_consumers,
        counters=None,
        stats_error=error,
        leader=int(info.leader_node_id),
        replicas=_ids(info.replica_node_ids),
        in_sync=_ids(info.in_sync_node_ids),
    )


def _ids(nodes: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(n) for n in nodes)


def _from_stats(
    info: admin_pb2.QueueInfo, stats: admin_pb2.GetStatsResponse, now: float
) -> QueueSample:
    return QueueSample(
        at=now,
        depth=stats.depth,
        in_flight=stats.in_flight,
        consumers=stats.active_consumers,
        counters=Counters(
            enqueued=stats.enqueued_total,
            delivered=stats.delivered_total,
            acked=stats.acked_total,
            nacked=stats.nacked_total,
            expired=stats.expired_total,
            dead_lettered=stats.dead_lettered_total,
        ),
        keys=tuple(
            KeyStat(k.key, k.pending_count, k.current_deficit, k.weight, k.delivered_total)
            for k in stats.per_key_stats
        ),
        throttles=tuple(
            ThrottleStat(t.key, t.tokens, t.rate_per_second, t.burst)
            for t in stats.per_throttle_stats
        ),
        quantum=stats.quantum,
        active_keys=stats.active_fairness_keys,
        delayed=stats.delayed,
        hook_errors=stats.hook_errors_total,
        last_hook_error=stats.last_hook_error,
        last_hook_error_at_ms=stats.last_hook_error_at.ToMilliseconds(),
        leader=int(info.leader_node_id),
        replicas=_ids(info.replica_node_ids),
        in_sync=_ids(info.in_sync_node_ids),
    )
