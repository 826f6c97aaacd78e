"""Enqueue throughput with 1 KB payloads: one producer, and 50 over five connections.

In sync mode every answer waits for an fsync, so the single producer measures the
round trip plus one fsync per message, and 50 producers show what group commit gains
by sharing one fsync among every write that arrived meanwhile. Buffer mode removes the
fsync and leaves protocol and broker CPU. The 50 producers use five dedicated TCP
connections (ten producers multiplexed on each, see `fila_bench.conn`).
"""

from __future__ import annotations

from fila.config import PersistMode
from fila_bench.case import Case, Context
from fila_bench.conn import close_all, open_connections
from fila_bench.load import enqueue_for
from fila_bench.results import Result, throughput
from fila_bench.server import broker
from fila_sdk import AsyncClient

QUEUE = "bench"
MULTI_PRODUCERS = 50
MULTI_CONNECTIONS = 5


def _case(mode: PersistMode, producers: int) -> Case:
    name = f"enqueue_1kb_{mode}_{producers}p"

    async def run(ctx: Context) -> list[Result]:
        p = ctx.profile
        async with broker(ctx, name, mode) as server, AsyncClient(server.addr) as admin:
            await admin.create_queue(QUEUE)
            conns = [admin] if producers == 1 else open_connections(server.addr, MULTI_CONNECTIONS)
            ctx.status(f"{producers} producers, {p.warmup_s:g}s warmup + {p.measure_s:g}s")
            try:
                run = await enqueue_for(
                    conns, producers, QUEUE, warmup_s=p.warmup_s, measure_s=p.measure_s
                )
            finally:
                if producers != 1:
                    await close_all(conns)
        return [throughput(name, run.rate, latency_bound=producers == 1)]

    return Case(name, (name,), run, ratios=(name,))


CASES = [
    _case(mode, producers) for mode in ("sync", "buffer") for producers in (1, MULTI_PRODUCERS)
]
