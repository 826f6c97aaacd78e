"""End-to-end latency at light load: enqueue send to consume receive, p50/p95/p99.

One producer sends 1 KB messages on a fixed schedule (200 msg/s by default, far below
saturation, so the number is the path through the broker, not queueing in it); one
consumer acks each message. The producer stamps each message's *scheduled* send
time into a header and the consumer subtracts it on receipt, in the same process, so
no clocks need to agree. Timing from the schedule, not from the moment the producer
got round to sending, counts the wait of every message held up behind a slow answer
(no coordinated omission). Durable (sync) mode, the default, so every message pays
its fsync before it becomes deliverable. Percentiles come from an HDR histogram.

The same client and schedule first run against the latency floor
(`fila_bench.floor`: a bare gRPC server that only syncs and relays), so the run also
says what this host allowed at the time: `latency_floor_p50_ms` (p95, p99) and
`latency_p50_over_floor`, the broker's p50 over the floor's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from hdrh.histogram import HdrHistogram

from fila_bench.case import Case, Context
from fila_bench.floor import latency_floor
from fila_bench.load import (
    PAYLOAD_1KB,
    check_exactly_once,
    histogram,
    paced,
    percentile_ms,
    run_until,
)
from fila_bench.results import RATIO, Result, latency_ms
from fila_bench.server import broker
from fila_sdk import AsyncClient

QUEUE = "latency"
SENT_HEADER = "sent-ns"
PERCENTILES = (50.0, 95.0, 99.0)
OUTPUTS = (
    "latency_p50_ms",
    "latency_p95_ms",
    "latency_p99_ms",
    "latency_floor_p50_ms",
    "latency_floor_p95_ms",
    "latency_floor_p99_ms",
    "latency_p50_over_floor",
)


@dataclass
class _Run:
    hist: HdrHistogram
    sent: list[str]
    received: list[str]


async def _measure(ctx: Context, addr: str, what: str) -> _Run:
    """The paced producer and the acking consumer against the server at `addr`."""
    p = ctx.profile
    run = _Run(histogram(), [], [])
    all_received = asyncio.Event()
    producing = True

    async with AsyncClient(addr) as client:
        await client.create_queue(QUEUE)

        async def consume() -> None:
            async for msg in client.consume(QUEUE):
                elapsed_ns = time.perf_counter_ns() - int(msg.headers[SENT_HEADER])
                run.hist.record_value(max(1, elapsed_ns // 1000))
                await client.ack(QUEUE, msg.id)
                run.received.append(msg.id)
                if not producing and len(run.received) >= len(run.sent):
                    all_received.set()

        async def produce() -> None:
            nonlocal producing
            stop_at = time.perf_counter() + p.latency_s
            async for scheduled in paced(p.latency_rate, lambda: time.perf_counter() >= stop_at):
                headers = {SENT_HEADER: str(round(scheduled * 1e9))}
                run.sent.append(await client.enqueue(QUEUE, headers, PAYLOAD_1KB))
            producing = False
            if len(run.received) >= len(run.sent):
                all_received.set()

        ctx.status(f"{what}: {p.latency_rate} msg/s for {p.latency_s:g}s")
        await run_until(
            all_received,
            [consume(), produce()],
            p.latency_s + p.deadline_s,
            lambda: f"{len(run.received)}/{len(run.sent)} received",
        )
    check_exactly_once(what, run.sent, run.received)
    return run


async def _run(ctx: Context) -> list[Result]:
    server_cpus = ctx.placement.server if ctx.placement is not None else None
    async with latency_floor(ctx.workdir, server_cpus) as floor:
        floor_run = await _measure(ctx, floor.addr, "latency floor")
    floor.check_synced(len(floor_run.sent))
    async with broker(ctx, "latency", "sync") as server:
        run = await _measure(ctx, server.addr, "latency")
    # Reported, not gated: one message in flight measures how quickly a busy host
    # schedules the processes; on a shared two-core host the median moved many times
    # over and the tail more (docs/benchmarks.md, "Noise and the gate" and
    # "Measurements behind design choices").
    ours = [percentile_ms(run.hist, pct) for pct in PERCENTILES]
    floor_ms = [percentile_ms(floor_run.hist, pct) for pct in PERCENTILES]
    figures = [*ours, *floor_ms]
    results = [
        latency_ms(name, value, gated=False)
        for name, value in zip(OUTPUTS[:-1], figures, strict=True)
    ]
    over = Result(OUTPUTS[-1], ours[0] / floor_ms[0], RATIO, higher_is_better=False, gated=False)
    return [*results, over]


CASES = [Case("latency_light", OUTPUTS, _run)]
