"""Durable (sync) versus buffered enqueue and drain at 1, 8 and 50 connections.

The seed methodology: N producers, each on its own TCP connection with one enqueue
in flight, for a fixed window; then N workers on those connections consume and ack
one message at a time until the queue is empty, and the timer stops at the last ack.
Both go through the SDK as its users would: `enqueue` rides a `StreamEnqueue` stream,
and each worker is a `fila_sdk.Worker` with `concurrency=1`, acking on its
`StreamConsume` stream, so one message in flight costs frames, not calls.
Every id answered by an enqueue must be delivered exactly once (conservation), and
the broker must report the queue empty afterwards. In sync mode every answer waits
for an fsync; group commit is what should make throughput grow with N. Messages are
256 bytes, job-sized, as in the seed reports.

Each case also measures, just before its broker, the stream ceiling at its connection
count (`fila_bench.echo.stream_ceiling`: the SDK's `enqueue` against an echo server
that answers `StreamEnqueue` at once), and reports both rates over it
(`<label>_{enqueue,drain}_<n>c_over_stream_echo`): the enqueue rides that stream and
the drain's worker settles on its own, so this is the ceiling that matches, where the
runner's `<rate>_ratio` is over the unary one. And the broker's CPU per job over
enqueue and drain together (`<label>_<n>c_cpu_us_per_job`). At one connection these
are latency-bound and not gated, like the rates.

`durable_over_buffered_50c` measures the ratio of the two 50-connection enqueue rates
a second way. The rows above run a minute apart, and on a shared host a mode's rate
drifts between minutes, moving the ratio of the two rows far more than a change in
the broker would (figures: docs/benchmarks.md). Here both brokers
run at once, each with its own 50 connections, and only one is loaded at a time: the
measurement alternates between them in short slices (durable first in one pair,
buffered first in the next), so both see the same host. The rows stay as they are,
comparable with the seeds.
"""

from __future__ import annotations

from fila.config import PersistMode
from fila_bench.case import Case, Context
from fila_bench.conn import Connection, close_all, open_connections
from fila_bench.echo import PAYLOAD_256B, echo_server, stream_ceiling
from fila_bench.load import (
    check_empty,
    check_exactly_once,
    check_stored,
    enqueue_for,
    worker_drain,
)
from fila_bench.results import RATIO, Result, cpu_per_job, over_ceiling, throughput
from fila_bench.server import broker, cpu_seconds
from fila_sdk import AsyncClient

CONNECTIONS = (1, 8, 50)
PAYLOAD = PAYLOAD_256B  # the echo ceiling sends the same, so the ratio compares like with like
QUEUE = "jobs"
LABELS: dict[PersistMode, str] = {"sync": "durable", "buffer": "buffered"}


def _case(mode: PersistMode, connections: int) -> Case:
    label = LABELS[mode]
    enqueue_name = f"{label}_enqueue_{connections}c"
    drain_name = f"{label}_drain_{connections}c"
    name = f"{label}_{connections}c"
    over_echo = (f"{enqueue_name}_over_stream_echo", f"{drain_name}_over_stream_echo")
    cpu_name = f"{name}_cpu_us_per_job"

    async def run(ctx: Context) -> list[Result]:
        p = ctx.profile
        ctx.status(f"stream echo ceiling, {connections} connections")
        async with echo_server(ctx.placement.server if ctx.placement else None) as echo:
            ceiling = await stream_ceiling(
                echo, connections, PAYLOAD, warmup_s=p.warmup_s, measure_s=p.measure_s
            )
        async with broker(ctx, name, mode) as server, AsyncClient(server.addr) as admin:
            await admin.create_queue(QUEUE)
            conns = open_connections(server.addr, connections)
            try:
                cpu_before = cpu_seconds(server.pid)
                ctx.status(f"enqueue, {connections} connections")
                enq = await enqueue_for(
                    conns,
                    connections,
                    QUEUE,
                    warmup_s=p.warmup_s,
                    measure_s=p.measure_s,
                    payload=PAYLOAD,
                )
                ctx.status(f"drain {len(enq.ids):,}, {connections} connections")
                drain = await worker_drain(conns, QUEUE, len(enq.ids), deadline_s=p.deadline_s)
                cpu_s = cpu_seconds(server.pid) - cpu_before
            finally:
                await close_all(conns)
            check_exactly_once(name, enq.ids, [m.id for m in drain.deliveries])
            await check_empty(admin, QUEUE)
        gated = connections > 1
        return [
            throughput(enqueue_name, enq.rate, latency_bound=not gated),
            throughput(drain_name, drain.rate, latency_bound=not gated),
            over_ceiling(over_echo[0], enq.rate, ceiling, gated=gated),
            over_ceiling(over_echo[1], drain.rate, ceiling, gated=gated),
            cpu_per_job(cpu_name, cpu_s, len(enq.ids), gated=gated),
        ]

    rates = (enqueue_name, drain_name)
    return Case(name, (*rates, *over_echo, cpu_name), run, ratios=rates)


PAIRED_CONNECTIONS = 50
PAIRED_SLICE_S = 0.5  # counted per slice; the profile's measure_s sets how many
PAIRED_SETTLE_S = 0.1  # each slice's first answers, while the streams refill, not counted
PAIRED_NAME = f"durable_over_buffered_{PAIRED_CONNECTIONS}c"


async def _paired(ctx: Context) -> list[Result]:
    p = ctx.profile
    slices = max(2, round(p.measure_s / PAIRED_SLICE_S))
    rates: dict[PersistMode, list[float]] = {"sync": [], "buffer": []}
    ids: dict[PersistMode, list[str]] = {"sync": [], "buffer": []}
    async with (
        broker(ctx, "paired_durable", "sync") as durable,
        broker(ctx, "paired_buffered", "buffer") as buffered,
        AsyncClient(durable.addr) as durable_admin,
        AsyncClient(buffered.addr) as buffered_admin,
    ):
        admins: dict[PersistMode, AsyncClient] = {"sync": durable_admin, "buffer": buffered_admin}
        conns: dict[PersistMode, list[Connection]] = {}
        try:
            for (mode, admin), server in zip(admins.items(), (durable, buffered), strict=True):
                await admin.create_queue(QUEUE)
                conns[mode] = list(open_connections(server.addr, PAIRED_CONNECTIONS))

            async def load(mode: PersistMode, warmup_s: float, measure_s: float) -> float:
                run = await enqueue_for(
                    conns[mode],
                    PAIRED_CONNECTIONS,
                    QUEUE,
                    warmup_s=warmup_s,
                    measure_s=measure_s,
                    payload=PAYLOAD,
                )
                ids[mode] += run.ids
                return run.rate

            for mode in admins if p.warmup_s > 0 else ():
                ctx.status(f"warm-up, {LABELS[mode]}")
                await load(mode, 0.0, p.warmup_s)
            for index in range(slices):
                order: tuple[PersistMode, ...] = ("sync", "buffer")
                for mode in order if index % 2 == 0 else order[::-1]:
                    ctx.status(f"slice {index + 1}/{slices}, {LABELS[mode]}")
                    rates[mode].append(await load(mode, PAIRED_SETTLE_S, PAIRED_SLICE_S))
        finally:
            await close_all([c for pool in conns.values() for c in pool])
        for mode, admin in admins.items():
            await check_stored(admin, QUEUE, ids[mode])
    ratio = sum(rates["sync"]) / sum(rates["buffer"]) if sum(rates["buffer"]) else 0.0
    return [Result(PAIRED_NAME, ratio, RATIO, higher_is_better=True, gated=False)]


CASES = [
    *(_case(mode, n) for mode in ("sync", "buffer") for n in CONNECTIONS),
    Case(PAIRED_NAME, (PAIRED_NAME,), _paired),
]
