"""Cost of an `on_enqueue` hook per message: enqueue with and without it, alternating.

Eight producers keep the broker saturated (buffer mode, so no fsync noise), which
makes 1/throughput the broker's time per message; the difference of the two is the
hook's cost in microseconds. Both queues get identical headers. The two variants run
in alternating slices, swapping which goes first each round, so drift over the run
(caches, RocksDB growth, CPU frequency) falls on both sides equally.
"""

from __future__ import annotations

from fila_bench.benchmarks import keys_script
from fila_bench.case import Case, Context
from fila_bench.load import enqueue_for
from fila_bench.results import US, Result, throughput
from fila_bench.server import broker
from fila_sdk import AsyncClient

PRODUCERS = 8
HEADERS = {"key": "tenant-1"}
OUTPUTS = ("enqueue_lua_off", "enqueue_lua_on", "lua_overhead_us")


async def _run(ctx: Context) -> list[Result]:
    p = ctx.profile
    sent = {"plain": 0.0, "hooked": 0.0}
    async with broker(ctx.workdir, "lua", "buffer") as server, AsyncClient(server.addr) as client:
        await client.create_queue("plain")
        await client.create_queue("hooked", on_enqueue=keys_script())
        for queue in sent:  # warm both paths once, uncounted
            await enqueue_for(
                [client], PRODUCERS, queue, warmup_s=0.0, measure_s=p.warmup_s, headers=HEADERS
            )
        for round_no in range(p.lua_slices):
            order = ("plain", "hooked") if round_no % 2 == 0 else ("hooked", "plain")
            for queue in order:
                ctx.status(f"round {round_no + 1}/{p.lua_slices}: {queue}")
                run = await enqueue_for(
                    [client],
                    PRODUCERS,
                    queue,
                    warmup_s=0.0,
                    measure_s=p.lua_slice_s,
                    headers=HEADERS,
                )
                sent[queue] += run.rate * p.lua_slice_s
    seconds = p.lua_slices * p.lua_slice_s
    off, on = sent["plain"] / seconds, sent["hooked"] / seconds
    overhead_us = (1e6 / on - 1e6 / off) if on and off else 0.0
    return [
        throughput("enqueue_lua_off", off),
        throughput("enqueue_lua_on", on),
        Result("lua_overhead_us", overhead_us, US, higher_is_better=False, gated=False),
    ]


CASES = [Case("lua_on_enqueue", OUTPUTS, _run)]
