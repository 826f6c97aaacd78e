"""The competitive harness's cells of few connections and of unary calls, each against
the echo ceiling that matches it, measured in the same case.

`bench-competitive` ranks Fila against other brokers; these cells bring its
low-concurrency ones into `fila-bench system`, so the gate sees them on every change:

- `lifecycle_1w`: one producer (`AsyncClient.enqueue`, 1 KiB, one in flight) and one
  worker (`fila_sdk.Worker`, one slot, prefetch 1, acking on its stream) at once,
  until `LIFECYCLE_JOBS` jobs are enqueued and handled, as the harness's lifecycle
  cell; over the stream ceiling at one connection and 1 KiB;
- `producers_3`: three producers, 1 KiB, one in flight each, for a window; over the
  stream ceiling at three connections and 1 KiB;
- `durable_unary_50c`: the published clients' way, one unary call per message: 50
  connections of unary `Enqueue` (256 B) for a window, then 50 `Consume` streams
  acking each message with a unary `Ack`; the runner reports both over
  `echo_ceiling_50c`, which is exactly this stack's unary ceiling for them.

Each reports the broker's CPU per job (`<case>_cpu_us_per_job`, all threads, over the
whole case). The brokers are durable, with `scheduler.consumer_buffer = 1` where a
worker or a `Consume` stream holds one message at a time, as the harness runs Fila.
Conservation and empty-queue checks as everywhere.
"""

from __future__ import annotations

import asyncio
import time

from fila_bench.case import Case, Context
from fila_bench.conn import Connection, UnaryConnection, close_all, open_connections
from fila_bench.echo import PAYLOAD_256B, echo_server, stream_ceiling
from fila_bench.load import (
    PAYLOAD_1KB,
    CheckFailed,
    check_empty,
    check_exactly_once,
    check_stored,
    consume_until,
    enqueue_for,
)
from fila_bench.results import MSG_S, Result, cpu_per_job, over_ceiling, throughput
from fila_bench.server import broker, cpu_seconds
from fila_sdk import AsyncClient, Message, Worker

QUEUE = "cells"
ONE_AT_A_TIME = "[scheduler]\nconsumer_buffer = 1\n"
LIFECYCLE_JOBS_PER_S = 400  # jobs per second of the profile's window (2,000 full)


async def _ceiling(ctx: Context, connections: int, payload: bytes) -> float:
    p = ctx.profile
    ctx.status(f"stream echo ceiling, {connections} connection(s)")
    async with echo_server(ctx.placement.server if ctx.placement else None) as echo:
        return await stream_ceiling(
            echo, connections, payload, warmup_s=p.warmup_s, measure_s=p.measure_s
        )


# -- lifecycle, one worker --------------------------------------------------------------

LIFECYCLE = "lifecycle_1w"
LIFECYCLE_OUTPUTS = (
    f"{LIFECYCLE}_1kb",
    f"{LIFECYCLE}_1kb_over_stream_echo",
    f"{LIFECYCLE}_cpu_us_per_job",
)


async def _lifecycle(ctx: Context) -> list[Result]:
    p = ctx.profile
    jobs = max(200, int(LIFECYCLE_JOBS_PER_S * p.measure_s))
    ceiling = await _ceiling(ctx, 1, PAYLOAD_1KB)
    async with (
        broker(ctx, LIFECYCLE, "sync", ONE_AT_A_TIME) as server,
        AsyncClient(server.addr) as producer,
        AsyncClient(server.addr) as consumer,
    ):
        await producer.create_queue(QUEUE)
        ids: list[str] = []
        handled: list[str] = []
        done = asyncio.Event()

        async def handle(message: Message) -> None:
            handled.append(message.id)
            if len(handled) == jobs:
                done.set()

        ctx.status(f"{jobs:,} jobs, one producer and one worker")
        cpu_before = cpu_seconds(server.pid)
        started = time.perf_counter()
        async with Worker(consumer, QUEUE, handle, concurrency=1, prefetch=1):
            for _ in range(jobs):
                ids.append(await producer.enqueue(QUEUE, None, PAYLOAD_1KB))
            try:
                await asyncio.wait_for(done.wait(), p.deadline_s)
            except TimeoutError:
                raise CheckFailed(
                    f"{LIFECYCLE}: {len(handled)}/{jobs} handled within {p.deadline_s:g}s"
                ) from None
            elapsed = time.perf_counter() - started
        cpu_s = cpu_seconds(server.pid) - cpu_before
        check_exactly_once(LIFECYCLE, ids, handled)
        await check_empty(producer, QUEUE)
    rate = jobs / elapsed
    name, over, cpu = LIFECYCLE_OUTPUTS
    return [
        throughput(name, rate, latency_bound=True),
        over_ceiling(over, rate, ceiling, gated=False),
        cpu_per_job(cpu, cpu_s, jobs, gated=False),
    ]


# -- three producers ------------------------------------------------------------------------

PRODUCERS = "producers_3"
PRODUCERS_OUTPUTS = (
    "durable_enqueue_3p_1kb",
    "durable_enqueue_3p_1kb_over_stream_echo",
    f"{PRODUCERS}_cpu_us_per_job",
)


async def _producers(ctx: Context) -> list[Result]:
    p = ctx.profile
    ceiling = await _ceiling(ctx, 3, PAYLOAD_1KB)
    async with broker(ctx, PRODUCERS, "sync") as server, AsyncClient(server.addr) as admin:
        await admin.create_queue(QUEUE)
        conns = open_connections(server.addr, 3)
        try:
            ctx.status("enqueue, three producers")
            cpu_before = cpu_seconds(server.pid)
            run = await enqueue_for(
                conns, 3, QUEUE, warmup_s=p.warmup_s, measure_s=p.measure_s, payload=PAYLOAD_1KB
            )
            cpu_s = cpu_seconds(server.pid) - cpu_before
        finally:
            await close_all(conns)
        await check_stored(admin, QUEUE, run.ids)
    name, over, cpu = PRODUCERS_OUTPUTS
    return [
        Result(name, run.rate, MSG_S, higher_is_better=True, gated=False),  # gated as a ratio
        over_ceiling(over, run.rate, ceiling),
        cpu_per_job(cpu, cpu_s, len(run.ids)),
    ]


# -- unary, 50 connections ------------------------------------------------------------------

UNARY = "durable_unary_50c"
UNARY_CONNECTIONS = 50
UNARY_RATES = ("durable_unary_enqueue_50c", "durable_unary_drain_50c")
UNARY_OUTPUTS = (*UNARY_RATES, f"{UNARY}_cpu_us_per_job")


async def _unary(ctx: Context) -> list[Result]:
    p = ctx.profile
    async with (
        broker(ctx, UNARY, "sync", ONE_AT_A_TIME) as server,
        AsyncClient(server.addr) as admin,
    ):
        await admin.create_queue(QUEUE)
        conns: list[Connection] = [UnaryConnection(server.addr) for _ in range(UNARY_CONNECTIONS)]
        try:
            ctx.status("unary Enqueue, 50 connections")
            cpu_before = cpu_seconds(server.pid)
            enq = await enqueue_for(
                conns,
                UNARY_CONNECTIONS,
                QUEUE,
                warmup_s=p.warmup_s,
                measure_s=p.measure_s,
                payload=PAYLOAD_256B,
            )
            ctx.status(f"Consume and unary Ack, {len(enq.ids):,} messages")
            drain = await consume_until(
                conns, UNARY_CONNECTIONS, QUEUE, len(enq.ids), deadline_s=p.deadline_s
            )
            cpu_s = cpu_seconds(server.pid) - cpu_before
        finally:
            await close_all(conns)
        check_exactly_once(UNARY, enq.ids, [m.id for m in drain.deliveries])
        await check_empty(admin, QUEUE)
    return [
        throughput(UNARY_RATES[0], enq.rate),
        throughput(UNARY_RATES[1], drain.rate),
        cpu_per_job(UNARY_OUTPUTS[2], cpu_s, len(enq.ids)),
    ]


CASES = [
    Case(LIFECYCLE, LIFECYCLE_OUTPUTS, _lifecycle),
    Case(PRODUCERS, PRODUCERS_OUTPUTS, _producers),
    Case(UNARY, UNARY_OUTPUTS, _unary, ratios=UNARY_RATES),
]
