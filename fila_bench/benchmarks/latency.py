"""End-to-end latency at light load: enqueue send to consume receive, p50/p95/p99.

One producer sends 1 KB messages on a fixed schedule (200 msg/s by default, far below
saturation, so the number is the path through the broker, not queueing in it); one
consumer acks each message. The producer stamps each message's *scheduled* send
time into a header and the consumer subtracts it on receipt, in the same process, so
no clocks need to agree. Timing from the schedule, not from the moment the producer
got round to sending, counts the wait of every message held up behind a slow answer
(no coordinated omission). Durable (sync) mode, the default, so every message pays
its fsync before it becomes deliverable. Percentiles come from an HDR histogram.
"""

from __future__ import annotations

import asyncio
import time

from fila_bench.case import Case, Context
from fila_bench.load import (
    PAYLOAD_1KB,
    check_exactly_once,
    histogram,
    paced,
    percentile_ms,
    run_until,
)
from fila_bench.results import Result, latency_ms
from fila_bench.server import broker
from fila_sdk import AsyncClient

QUEUE = "latency"
SENT_HEADER = "sent-ns"
OUTPUTS = ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms")


async def _run(ctx: Context) -> list[Result]:
    p = ctx.profile
    hist = histogram()
    sent: list[str] = []
    received: list[str] = []
    all_received = asyncio.Event()
    producing = True

    async with broker(ctx, "latency", "sync") as server, AsyncClient(server.addr) as client:
        await client.create_queue(QUEUE)

        async def consume() -> None:
            async for msg in client.consume(QUEUE):
                elapsed_ns = time.perf_counter_ns() - int(msg.headers[SENT_HEADER])
                hist.record_value(max(1, elapsed_ns // 1000))
                await client.ack(QUEUE, msg.id)
                received.append(msg.id)
                if not producing and len(received) >= len(sent):
                    all_received.set()

        async def produce() -> None:
            nonlocal producing
            stop_at = time.perf_counter() + p.latency_s
            async for scheduled in paced(p.latency_rate, lambda: time.perf_counter() >= stop_at):
                headers = {SENT_HEADER: str(round(scheduled * 1e9))}
                sent.append(await client.enqueue(QUEUE, headers, PAYLOAD_1KB))
            producing = False
            if len(received) >= len(sent):
                all_received.set()

        ctx.status(f"{p.latency_rate} msg/s for {p.latency_s:g}s")
        await run_until(
            all_received,
            [consume(), produce()],
            p.latency_s + p.deadline_s,
            lambda: f"{len(received)}/{len(sent)} received",
        )
    check_exactly_once("latency", sent, received)
    # Reported, not gated: one message in flight measures how quickly a busy host
    # schedules the processes; on a shared two-core host the median moved 40-fold and
    # the tail more (docs/benchmarks.md, "Noise and the gate").
    return [
        latency_ms(name, percentile_ms(hist, pct), gated=False)
        for name, pct in zip(OUTPUTS, (50.0, 95.0, 99.0), strict=True)
    ]


CASES = [Case("latency_light", OUTPUTS, _run)]
