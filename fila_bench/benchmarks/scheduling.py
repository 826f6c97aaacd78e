"""The scheduler under load: DRR vs FIFO, fairness accuracy, key cardinality, consumers.

All of these preload a backlog first and then time only consumption, so they
measure delivery (DRR pick, lease, read back from RocksDB, send, ack) and not
enqueue. They run in buffer mode: an ack in sync mode waits for an fsync, whose
variance would drown the scheduling differences these benchmarks exist to show.
Fairness keys and weights come from a small `on_enqueue` hook reading headers;
every queue here, the single-key FIFO baseline included, runs that same hook so
the comparison is scheduling against scheduling: `drr_overhead_pct` is DRR over
100 keys against DRR over one key, not against a separate FIFO code path (there is
none). Drain rates are timed from the moment every consume stream has delivered
(see `consume_until`).
"""

from __future__ import annotations

import itertools
import math
import time

from fila_bench.benchmarks import keys_script
from fila_bench.case import Case, Context
from fila_bench.conn import close_all, open_connections
from fila_bench.load import (
    CheckFailed,
    DrainRun,
    check_at_most_once,
    check_empty,
    check_exactly_once,
    consume_until,
    preload,
)
from fila_bench.results import PCT, PP, Result, throughput
from fila_bench.server import broker, cpu_seconds
from fila_sdk import AsyncClient

PRELOAD_PRODUCERS = 20
DRR_KEYS = 100
WORKERS = 10  # enough concurrent consumers to keep the broker, not the client, busy
FAIRNESS_WEIGHTS = (1, 2, 3, 4, 5)
FAIRNESS_LIMIT_PP = 1.0  # SPEC 2: within 1 percentage point over 5,000 deliveries
FAIRNESS_SLACK = 0.02  # each key's backlog exceeds its share of the run by this much
CARDINALITIES = (10, 1_000, 10_000)
CONSUMER_COUNTS = (1, 10, 100)
# Consume streams per dedicated TCP connection in the consumer-scaling drain: one
# shared connection (what several AsyncClients give) makes 100 streams a test of the
# client's HTTP/2 connection, not of the broker.
STREAMS_PER_CONNECTION = 10


def _keyed(key_count: int) -> dict[int, dict[str, str]]:
    return {k: {"key": f"k{k}"} for k in range(key_count)}


async def _drain_all(
    ctx: Context, client: AsyncClient, queue: str, ids: list[str], workers: int
) -> DrainRun:
    ctx.status(f"draining {len(ids):,} from {queue} with {workers} consumers")
    run = await consume_until([client], workers, queue, len(ids), deadline_s=ctx.profile.deadline_s)
    check_exactly_once(queue, ids, [m.id for m in run.deliveries])
    await check_empty(client, queue)
    return run


async def _keyed_drain_rate(ctx: Context, queue: str, key_count: int) -> float:
    """Consume rate of a backlog spread round-robin over `key_count` keys, on a fresh
    broker, so neither side of the comparison inherits the other's tombstones."""
    p = ctx.profile
    keys = _keyed(key_count)
    async with broker(ctx, queue, "buffer") as server, AsyncClient(server.addr) as client:
        await client.create_queue(queue, on_enqueue=keys_script())
        ctx.status(f"preloading {p.drr_backlog:,} over {key_count} key(s)")
        ids = await preload(
            [client],
            PRELOAD_PRODUCERS,
            queue,
            p.drr_backlog,
            deadline_s=p.deadline_s,
            headers_for=lambda i: keys[i % key_count],
        )
        return (await _drain_all(ctx, client, queue, ids, WORKERS)).rate


async def _drr_vs_fifo(ctx: Context) -> list[Result]:
    fifo = await _keyed_drain_rate(ctx, "fifo", 1)
    drr = await _keyed_drain_rate(ctx, "drr", DRR_KEYS)
    overhead = (fifo - drr) / fifo * 100 if fifo else 0.0
    return [
        throughput("consume_fifo_1key", fifo),
        throughput(f"consume_drr_{DRR_KEYS}keys", drr),
        Result("drr_overhead_pct", overhead, PCT, higher_is_better=False, gated=False),
    ]


async def _fairness(ctx: Context) -> list[Result]:
    """Backlog every key beyond its share of a long run, read the run in lease order,
    and check every window of `fairness_window` deliveries, sliding by `fairness_step`.

    One consumer, so the order of deliveries is the broker's lease order. Every key
    stays backlogged to the end of the run (its backlog exceeds its share by
    FAIRNESS_SLACK), so a window that strays is the scheduler's doing, not a key that
    ran dry.
    """
    p = ctx.profile
    total = sum(FAIRNESS_WEIGHTS)
    plan: list[dict[str, str]] = []
    for weight in FAIRNESS_WEIGHTS:
        quota = math.ceil(p.fairness_run * weight / total * (1 + FAIRNESS_SLACK)) + 100
        plan += [{"key": f"tenant-{weight}", "weight": str(weight)}] * quota
    async with (
        broker(ctx, "fairness", "buffer") as server,
        AsyncClient(server.addr) as client,
    ):
        await client.create_queue("fair", on_enqueue=keys_script())
        ctx.status(f"preloading {len(plan):,} over weights 1:2:3:4:5")
        ids = await preload(
            [client],
            PRELOAD_PRODUCERS,
            "fair",
            len(plan),
            deadline_s=p.deadline_s,
            headers_for=plan.__getitem__,
        )
        ctx.status(f"reading {p.fairness_run:,} deliveries")
        run = await consume_until([client], 1, "fair", p.fairness_run, deadline_s=p.deadline_s)
    delivered = run.deliveries[: p.fairness_run]
    check_at_most_once("fairness", ids, [m.id for m in delivered])
    deviation, worst_at = max_window_deviation(
        [m.fairness_key for m in delivered], p.fairness_window, p.fairness_step
    )
    keys = [m.fairness_key for m in delivered]
    shares = [  # over the whole run, for the chart of shares against weights
        Result(share_name(w), keys.count(f"tenant-{w}") / len(keys) * 100, PCT, True, False)
        for w in FAIRNESS_WEIGHTS
    ]
    result = Result("fairness_max_deviation_pp", deviation, PP, higher_is_better=False, gated=False)
    if deviation > FAIRNESS_LIMIT_PP:
        raise CheckFailed(
            f"fairness: a key's share is {deviation:.2f} pp off its weight in the window of "
            f"{p.fairness_window:,} deliveries starting at delivery {worst_at:,} "
            f"(limit {FAIRNESS_LIMIT_PP} pp; windows every {p.fairness_step} over "
            f"{len(delivered):,})",
            [result, *shares],
        )
    return [result, *shares]


def share_name(weight: int) -> str:
    return f"fairness_share_w{weight}_pct"


def max_window_deviation(keys: list[str], window: int, step: int) -> tuple[float, int]:
    """Largest gap, in percentage points, between a key's share of a window and its
    weight's share (`tenant-<weight>`), over every window starting at a multiple of
    `step`; and where the worst window starts. Prefix counts make it one pass."""
    total = sum(FAIRNESS_WEIGHTS)
    worst, worst_at = 0.0, 0
    for weight in FAIRNESS_WEIGHTS:
        key = f"tenant-{weight}"
        prefix = [0, *itertools.accumulate(int(k == key) for k in keys)]
        for start in range(0, len(keys) - window + 1, step):
            share = (prefix[start + window] - prefix[start]) / window
            gap = abs(share - weight / total) * 100
            if gap > worst:
                worst, worst_at = gap, start
    return worst, worst_at


def _cardinality_case(key_count: int) -> Case:
    """Consume rate while `key_count` keys are active.

    The backlog is the same at every level (and at least one message per key) and
    only its first `cardinality_window` deliveries are timed, so the ring stays
    near `key_count` keys for the whole measurement.
    """
    name = f"consume_keys_{key_count}"

    async def run(ctx: Context) -> list[Result]:
        p = ctx.profile
        backlog = max(p.cardinality_backlog, key_count)
        window = min(p.cardinality_window, backlog)
        keys = _keyed(key_count)
        async with (
            broker(ctx, name, "buffer") as server,
            AsyncClient(server.addr) as client,
        ):
            await client.create_queue("keys", on_enqueue=keys_script())
            ctx.status(f"preloading {backlog:,} over {key_count:,} keys")
            ids = await preload(
                [client],
                PRELOAD_PRODUCERS,
                "keys",
                backlog,
                deadline_s=p.deadline_s,
                headers_for=lambda i: keys[i % key_count],
            )
            ctx.status(f"timing {window:,} deliveries")
            run = await consume_until([client], WORKERS, "keys", window, deadline_s=p.deadline_s)
        check_at_most_once(name, ids, [m.id for m in run.deliveries])
        return [throughput(name, run.rate)]

    return Case(f"cardinality_{key_count}", (name,), run, ratios=(name,))


def _consumers_case(consumers: int) -> Case:
    """Drain a real backlog (at least `concurrency_per_consumer` per stream) with
    `consumers` concurrent consume streams over dedicated connections, and say how
    busy the broker was: near 100% of a core means the broker, not this process, set
    the rate (`..._broker_cpu_pct`, informational)."""
    name = f"consume_consumers_{consumers}"
    cpu_name = f"{name}_broker_cpu_pct"

    async def run(ctx: Context) -> list[Result]:
        p = ctx.profile
        backlog = max(p.concurrency_backlog, consumers * p.concurrency_per_consumer)
        async with (
            broker(ctx, name, "buffer") as server,
            AsyncClient(server.addr) as client,
        ):
            await client.create_queue("work")
            conns = open_connections(server.addr, math.ceil(consumers / STREAMS_PER_CONNECTION))
            try:
                ctx.status(f"preloading {backlog:,}")
                ids = await preload(
                    conns, PRELOAD_PRODUCERS, "work", backlog, deadline_s=p.deadline_s
                )
                cpu_before, started = cpu_seconds(server.pid), time.perf_counter()
                ctx.status(f"draining {backlog:,} with {consumers} consumers")
                drained = await consume_until(
                    conns, consumers, "work", backlog, deadline_s=p.deadline_s
                )
                busy = (cpu_seconds(server.pid) - cpu_before) / (time.perf_counter() - started)
            finally:
                await close_all(conns)
            check_exactly_once(name, ids, [m.id for m in drained.deliveries])
            await check_empty(client, "work")
        return [
            throughput(name, drained.rate, latency_bound=consumers == 1),
            Result(cpu_name, busy * 100, PCT, higher_is_better=True, gated=False),
        ]

    return Case(f"consumers_{consumers}", (name, cpu_name), run, ratios=(name,))


CASES = [
    Case(
        "drr_vs_fifo",
        ("consume_fifo_1key", f"consume_drr_{DRR_KEYS}keys", "drr_overhead_pct"),
        _drr_vs_fifo,
        ratios=("consume_fifo_1key", f"consume_drr_{DRR_KEYS}keys"),
    ),
    Case(
        "fairness",
        ("fairness_max_deviation_pp", *(share_name(w) for w in FAIRNESS_WEIGHTS)),
        _fairness,
    ),
    *(_cardinality_case(k) for k in CARDINALITIES),
    *(_consumers_case(c) for c in CONSUMER_COUNTS),
]
