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
"""

from __future__ import annotations

from fila.config import PersistMode
from fila_bench.case import Case, Context
from fila_bench.conn import close_all, open_connections
from fila_bench.echo import PAYLOAD_256B
from fila_bench.load import check_empty, check_exactly_once, enqueue_for, worker_drain
from fila_bench.results import Result, throughput
from fila_bench.server import broker
from fila_sdk import AsyncClient

CONNECTIONS = (1, 8, 50)
PAYLOAD = PAYLOAD_256B  # the echo ceiling sends the same, so the ratio compares like with like
QUEUE = "jobs"
LABELS: dict[PersistMode, str] = {"sync": "durable", "buffer": "buffered"}


def _case(mode: PersistMode, connections: int) -> Case:
    label = LABELS[mode]
    enqueue_name = f"{label}_enqueue_{connections}c"
    drain_name = f"{label}_drain_{connections}c"

    async def run(ctx: Context) -> list[Result]:
        p = ctx.profile
        name = f"{label}_{connections}c"
        async with broker(ctx, name, mode) as server, AsyncClient(server.addr) as admin:
            await admin.create_queue(QUEUE)
            conns = open_connections(server.addr, connections, dedicated=True)
            try:
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
            finally:
                await close_all(conns)
            check_exactly_once(name, enq.ids, [m.id for m in drain.deliveries])
            await check_empty(admin, QUEUE)
        single = connections == 1
        return [
            throughput(enqueue_name, enq.rate, latency_bound=single),
            throughput(drain_name, drain.rate, latency_bound=single),
        ]

    outputs = (enqueue_name, drain_name)
    return Case(f"{label}_{connections}c", outputs, run, ratios=outputs)


CASES = [_case(mode, n) for mode in ("sync", "buffer") for n in CONNECTIONS]
