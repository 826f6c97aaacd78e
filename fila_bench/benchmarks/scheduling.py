"""The scheduler under load: DRR vs FIFO, fairness accuracy, key cardinality, consumers.

All of these preload a backlog first and then time only consumption, so they
measure delivery (DRR pick, lease, read back from RocksDB, send, ack) and not
enqueue. They run in buffer mode: an ack in sync mode waits for an fsync, whose
variance would drown the scheduling differences these benchmarks exist to show.
Fairness keys and weights come from a small `on_enqueue` hook reading headers;
every queue here, the single-key FIFO baseline included, runs that same hook so
the comparison is scheduling against scheduling.
"""

from __future__ import annotations

import math

from fila_bench.benchmarks import keys_script
from fila_bench.case import Case, Context
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
from fila_bench.server import broker
from fila_sdk import AsyncClient

PRELOAD_PRODUCERS = 20
DRR_KEYS = 100
WORKERS = 10  # enough concurrent consumers to keep the broker, not the client, busy
FAIRNESS_WEIGHTS = (1, 2, 3, 4, 5)
FAIRNESS_LIMIT_PP = 1.0  # SPEC 2: within 1 percentage point over 5,000 deliveries
CARDINALITIES = (10, 1_000, 10_000)
CONSUMER_COUNTS = (1, 10, 100)


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
    async with broker(ctx.workdir, queue, "buffer") as server, AsyncClient(server.addr) as client:
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
    """Backlog every key beyond its share of the window, then read one window in order.

    One consumer, so the order of deliveries is the broker's lease order.
    """
    p = ctx.profile
    total = sum(FAIRNESS_WEIGHTS)
    plan: list[dict[str, str]] = []
    for weight in FAIRNESS_WEIGHTS:
        # Its share of the window, plus slack for the consumer's prefetch buffer.
        quota = math.ceil(p.fairness_window * weight / total) + 200
        plan += [{"key": f"tenant-{weight}", "weight": str(weight)}] * quota
    async with (
        broker(ctx.workdir, "fairness", "buffer") as server,
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
        ctx.status(f"reading a window of {p.fairness_window:,}")
        run = await consume_until([client], 1, "fair", p.fairness_window, deadline_s=p.deadline_s)
    window = run.deliveries[: p.fairness_window]
    check_at_most_once("fairness", ids, [m.id for m in window])
    deviation = 0.0
    for weight in FAIRNESS_WEIGHTS:
        got = sum(1 for m in window if m.fairness_key == f"tenant-{weight}")
        deviation = max(deviation, abs(got / len(window) - weight / total) * 100)
    result = Result("fairness_max_deviation_pp", deviation, PP, higher_is_better=False, gated=False)
    if deviation > FAIRNESS_LIMIT_PP:
        raise CheckFailed(
            f"fairness: a key's share is {deviation:.2f} pp off its weight "
            f"(limit {FAIRNESS_LIMIT_PP} pp over {len(window):,} deliveries)",
            [result],
        )
    return [result]


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
            broker(ctx.workdir, name, "buffer") as server,
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

    return Case(f"cardinality_{key_count}", (name,), run)


def _consumers_case(consumers: int) -> Case:
    """Drain one backlog with `consumers` concurrent consume streams."""
    name = f"consume_consumers_{consumers}"

    async def run(ctx: Context) -> list[Result]:
        p = ctx.profile
        async with (
            broker(ctx.workdir, name, "buffer") as server,
            AsyncClient(server.addr) as client,
        ):
            await client.create_queue("work")
            ctx.status(f"preloading {p.concurrency_backlog:,}")
            ids = await preload(
                [client], PRELOAD_PRODUCERS, "work", p.concurrency_backlog, deadline_s=p.deadline_s
            )
            run = await _drain_all(ctx, client, "work", ids, consumers)
        return [throughput(name, run.rate)]

    return Case(f"consumers_{consumers}", (name,), run)


CASES = [
    Case(
        "drr_vs_fifo",
        ("consume_fifo_1key", f"consume_drr_{DRR_KEYS}keys", "drr_overhead_pct"),
        _drr_vs_fifo,
    ),
    Case("fairness", ("fairness_max_deviation_pp",), _fairness),
    *(_cardinality_case(k) for k in CARDINALITIES),
    *(_consumers_case(c) for c in CONSUMER_COUNTS),
]
