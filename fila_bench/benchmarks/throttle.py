"""Throttle accuracy: a token bucket of 20/s with burst 5 over a 200-message backlog.

Over the first 5 s of consumption the broker should deliver the burst plus 5 s of
refill, 20 x 5 + 5 = 105 messages, however fast the consumer is (SPEC 2). Runs in
buffer mode: the bucket, not the fsync, must be what paces delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from fila_bench.case import Case, Context
from fila_bench.load import CheckFailed, preload
from fila_bench.results import COUNT, PCT, Result, throughput
from fila_bench.server import broker
from fila_sdk import AsyncClient

RATE, BURST, BACKLOG, WINDOW_S = 20.0, 5.0, 200, 5.0
EXPECTED = RATE * WINDOW_S + BURST
TOLERANCE_PCT = 10.0
HOOK = 'function on_enqueue(msg) return { fairness_key = "k", throttle_keys = { "t" } } end'
OUTPUTS = ("throttle_delivered_5s", "throttle_error_pct", "throttle_steady_rate")


async def _run(ctx: Context) -> list[Result]:
    async with (
        broker(ctx.workdir, "throttle", "buffer") as server,
        AsyncClient(server.addr) as client,
    ):
        await client.create_queue("throttled", on_enqueue=HOOK)
        await client.set_config("throttle.t", f"{RATE:g},{BURST:g}")
        ctx.status(f"preloading {BACKLOG}")
        await preload([client], 8, "throttled", BACKLOG, deadline_s=ctx.profile.deadline_s)
        ctx.status(f"consuming for {WINDOW_S:g}s at {RATE:g}/s, burst {BURST:g}")
        arrivals: list[float] = []
        started = time.perf_counter()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WINDOW_S):
                async for message in client.consume("throttled"):
                    arrivals.append(time.perf_counter() - started)
                    await client.ack("throttled", message.id)
    delivered = sum(1 for t in arrivals if t <= WINDOW_S)
    steady = sum(1 for t in arrivals if 1.0 < t <= WINDOW_S) / (WINDOW_S - 1.0)
    error_pct = (delivered - EXPECTED) / EXPECTED * 100
    results = [
        Result("throttle_delivered_5s", delivered, COUNT, higher_is_better=False, gated=False),
        Result("throttle_error_pct", abs(error_pct), PCT, higher_is_better=False, gated=False),
        throughput("throttle_steady_rate", steady),
    ]
    if abs(error_pct) > TOLERANCE_PCT:
        raise CheckFailed(
            f"throttle delivered {delivered} in {WINDOW_S:g}s, expected {EXPECTED:g} "
            f"within {TOLERANCE_PCT:g}%",
            results,
        )
    return results


CASES = [Case("throttle_accuracy", OUTPUTS, _run)]
