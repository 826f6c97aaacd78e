"""Throttle accuracy: a token bucket of 20/s with burst 5 over a 200-message backlog.

From the first delivery, the broker should deliver the burst plus 5 s of refill,
20 x 5 + 5 = 105 messages in 5 s, however fast the consumer is (SPEC 2), and between
1 s and 5 s it should deliver at the configured 20/s. Both are judged by their error
from what the configuration asks for, in either direction: a throttle that leaks is
as wrong as one that starves, so a higher delivery rate is never "better" here. Each
error past its tolerance fails the benchmark (and so the run and any comparison);
the figures themselves are reported, ungated, because a relative change of an error
near zero is noise. The clock starts at the first delivery, so opening the stream
is not counted. Runs in buffer mode: the bucket, not the fsync, must pace delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time

from fila_bench.case import Case, Context
from fila_bench.load import CheckFailed, preload
from fila_bench.results import COUNT, MSG_S, PCT, Result
from fila_bench.server import broker
from fila_sdk import AsyncClient

RATE, BURST, BACKLOG, WINDOW_S = 20.0, 5.0, 200, 5.0
STEADY_FROM_S = 1.0  # the burst is spent well before this
EXPECTED = RATE * WINDOW_S + BURST
TOLERANCE_PCT = 10.0
HOOK = 'function on_enqueue(msg) return { fairness_key = "k", throttle_keys = { "t" } } end'
OUTPUTS = (
    "throttle_delivered_5s",
    "throttle_error_pct",
    "throttle_steady_rate",
    "throttle_steady_error_pct",
)
_STREAM_OPEN_LIMIT_S = 10.0


async def _run(ctx: Context) -> list[Result]:
    async with (
        broker(ctx, "throttle", "buffer") as server,
        AsyncClient(server.addr) as client,
    ):
        await client.create_queue("throttled", on_enqueue=HOOK)
        await client.set_config("throttle.t", f"{RATE:g},{BURST:g}")
        ctx.status(f"preloading {BACKLOG}")
        await preload([client], 8, "throttled", BACKLOG, deadline_s=ctx.profile.deadline_s)
        ctx.status(f"consuming for {WINDOW_S:g}s at {RATE:g}/s, burst {BURST:g}")
        arrivals: list[float] = []
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_STREAM_OPEN_LIMIT_S) as window:
                async for message in client.consume("throttled"):
                    now = time.perf_counter()
                    if not arrivals:  # the window is WINDOW_S from the first delivery
                        window.reschedule(loop.time() + WINDOW_S + 0.05)
                    arrivals.append(now)
                    await client.ack("throttled", message.id)
    since_first = [t - arrivals[0] for t in arrivals] if arrivals else []
    delivered = sum(1 for t in since_first if t <= WINDOW_S)
    steady = steady_rate([t for t in since_first if STEADY_FROM_S < t <= WINDOW_S])
    error_pct = abs(delivered - EXPECTED) / EXPECTED * 100
    steady_error_pct = abs(steady - RATE) / RATE * 100
    results = [
        Result("throttle_delivered_5s", delivered, COUNT, higher_is_better=False, gated=False),
        Result("throttle_error_pct", error_pct, PCT, higher_is_better=False, gated=False),
        Result("throttle_steady_rate", steady, MSG_S, higher_is_better=False, gated=False),
        Result("throttle_steady_error_pct", steady_error_pct, PCT, False, gated=False),
    ]
    problems = []
    if error_pct > TOLERANCE_PCT:
        problems.append(f"delivered {delivered} in {WINDOW_S:g}s, expected {EXPECTED:g}")
    if steady_error_pct > TOLERANCE_PCT:
        problems.append(f"steady rate {steady:.1f}/s, configured {RATE:g}/s")
    if problems:
        raise CheckFailed(
            f"throttle off by more than {TOLERANCE_PCT:g}%: " + "; ".join(problems), results
        )
    return results


def steady_rate(arrivals: list[float]) -> float:
    """Deliveries per second in the window, as one over the median gap between arrivals.

    Not a count between the window's edges: the stream buffers up to its prefetch of
    messages, so a load generator that stalls on a busy host receives them late and
    in a bunch, and a count between fixed edges moves by however many the stall
    pushed across an edge (seen at load average 14: 22.5/s for a 20/s bucket). A
    bunch is a run of near-zero gaps, a minority the median ignores; a throttle that
    leaks shortens every gap, and the median follows.
    """
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    if not gaps:
        return 0.0
    median = statistics.median(gaps)
    return 1.0 / median if median > 0 else float("inf")


CASES = [Case("throttle_accuracy", OUTPUTS, _run)]
