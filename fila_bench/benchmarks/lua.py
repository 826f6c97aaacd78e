"""Cost of an `on_enqueue` hook per message: broker CPU per enqueue with and without it.

Eight producers on four dedicated connections enqueue into a queue without and one
with the hook, in alternating slices that swap which goes first each round, so drift
over the run (caches, RocksDB growth, CPU frequency) falls on both sides equally.
Both queues get identical headers, and buffer mode keeps the fsync out.

The hook's cost is read from the broker's own CPU time (`/proc/<pid>/stat`, every
thread) divided by the messages it accepted in the slice: microseconds of broker CPU
per message with the hook minus without. An earlier version took 1e6/throughput as
the broker's time per message, which holds only when the broker is saturated; one
load-generating process sharing the host cannot promise that, and when the client is
the bottleneck the difference of two rates says nothing about the hook. CPU per
message needs no saturation. The two rates are still reported (and gated as ratios to
the echo ceiling); the overhead itself is informational, a small difference of two
larger numbers.
"""

from __future__ import annotations

from fila_bench.benchmarks import keys_script
from fila_bench.case import Case, Context
from fila_bench.conn import close_all, open_connections
from fila_bench.load import enqueue_for
from fila_bench.results import US, Result, throughput
from fila_bench.server import broker, cpu_seconds
from fila_sdk import AsyncClient

PRODUCERS = 8
CONNECTIONS = 4
HEADERS = {"key": "tenant-1"}
OUTPUTS = ("enqueue_lua_off", "enqueue_lua_on", "lua_overhead_us")


async def _run(ctx: Context) -> list[Result]:
    p = ctx.profile
    sent = {"plain": 0, "hooked": 0}
    cpu = {"plain": 0.0, "hooked": 0.0}
    async with broker(ctx, "lua", "buffer") as server, AsyncClient(server.addr) as client:
        await client.create_queue("plain")
        await client.create_queue("hooked", on_enqueue=keys_script())
        conns = open_connections(server.addr, CONNECTIONS)
        try:
            for queue in sent:  # warm both paths once, uncounted
                await enqueue_for(
                    conns, PRODUCERS, queue, warmup_s=0.0, measure_s=p.warmup_s, headers=HEADERS
                )
            for round_no in range(p.lua_slices):
                order = ("plain", "hooked") if round_no % 2 == 0 else ("hooked", "plain")
                for queue in order:
                    ctx.status(f"round {round_no + 1}/{p.lua_slices}: {queue}")
                    cpu_before = cpu_seconds(server.pid)
                    run = await enqueue_for(
                        conns,
                        PRODUCERS,
                        queue,
                        warmup_s=0.0,
                        measure_s=p.lua_slice_s,
                        headers=HEADERS,
                    )
                    cpu[queue] += cpu_seconds(server.pid) - cpu_before
                    sent[queue] += len(run.ids)
        finally:
            await close_all(conns)
    seconds = p.lua_slices * p.lua_slice_s
    off, on = sent["plain"] / seconds, sent["hooked"] / seconds
    per_msg = {q: cpu[q] / sent[q] * 1e6 if sent[q] else 0.0 for q in sent}
    return [
        throughput("enqueue_lua_off", off),
        throughput("enqueue_lua_on", on),
        Result(
            "lua_overhead_us",
            per_msg["hooked"] - per_msg["plain"],
            US,
            higher_is_better=False,
            gated=False,
        ),
    ]


CASES = [Case("lua_on_enqueue", OUTPUTS, _run, ratios=OUTPUTS[:2])]
