"""What the broker costs the host: RSS idle and under load, and tail latency while
RocksDB flushes and compacts.

RSS is read from /proc/<pid>/status of the broker process itself (VmRSS), idle
after startup and as the peak over a loaded window. The compaction benchmark is
best effort, because a client cannot start a compaction: it writes a burst of large
messages (enough to fill several memtables, so RocksDB flushes them and
compacts level 0) while a paced probe keeps measuring enqueue latency, and it reads
RocksDB's own LOG to count the flushes and compactions that actually happened.
"""

from __future__ import annotations

import asyncio
import os
import time

from fila.testing.server import ServerProcess
from fila_bench.case import Case, Context
from fila_bench.conn import close_all, open_connections
from fila_bench.load import (
    PAYLOAD_1KB,
    background,
    enqueue_for,
    histogram,
    paced,
    percentile_ms,
    preload,
)
from fila_bench.results import COUNT, MIB, Result, latency_ms
from fila_bench.server import RssPeak, broker, rocksdb_events, rss_mib
from fila_sdk import AsyncClient

IDLE_SETTLE_S = 1.0
LOAD_PRODUCERS = 50
LOAD_CONNECTIONS = 5
LOAD_CONSUMERS = 10
PROBE_RATE = 200
BURST_PRODUCERS = 8
BURST_CONNECTIONS = 4
SETTLE_MAX_S = 10.0  # how long the probe keeps running after the burst for compactions


async def _ack_everything(client: AsyncClient, queue: str) -> None:
    async for msg in client.consume(queue):
        await client.ack(queue, msg.id)


async def _rss(ctx: Context) -> list[Result]:
    p = ctx.profile
    async with broker(ctx, "rss", "sync") as server, AsyncClient(server.addr) as client:
        await client.create_queue("rss")
        await asyncio.sleep(IDLE_SETTLE_S)
        idle = rss_mib(server.pid)
        ctx.status(f"{LOAD_PRODUCERS} producers + {LOAD_CONSUMERS} consumers")
        peak = RssPeak(server.pid)
        conns = open_connections(server.addr, LOAD_CONNECTIONS)
        consumers = [_ack_everything(client, "rss") for _ in range(LOAD_CONSUMERS)]
        try:
            async with background(peak.run(), *consumers):
                await enqueue_for(
                    conns, LOAD_PRODUCERS, "rss", warmup_s=p.warmup_s, measure_s=p.measure_s
                )
        finally:
            await close_all(conns)
    return [
        Result("rss_idle_mib", idle, MIB, higher_is_better=False),
        Result("rss_load_mib", max(peak.peak_mib, idle), MIB, higher_is_better=False),
    ]


async def _compaction(ctx: Context) -> list[Result]:
    p = ctx.profile
    samples: list[tuple[float, float]] = []  # (sent at, enqueue latency in us)
    probing = True
    async with (
        broker(ctx, "compaction", "sync") as server,
        AsyncClient(server.addr) as client,
    ):
        await client.create_queue("probe")
        await client.create_queue("burst")

        probes_answered = asyncio.Event()

        async def one_probe(sent_at: float) -> None:
            await client.enqueue("probe", None, PAYLOAD_1KB)
            samples.append((sent_at, (time.perf_counter() - sent_at) * 1e6))

        async def probe() -> None:
            # Open loop (as wrk2 drives a server): every tick is its own request, sent on
            # schedule whether or not the earlier ones were answered, and timed from its
            # scheduled send, so a stall charges every tick scheduled during it. With one
            # probe in flight instead, the ticks the burst held up were sent back to back
            # after it, and a tick scheduled after the burst waited for them: the
            # after-burst figure then measured the burst's backlog in the probe's own
            # queue (its p99 tracked the burst's; docs/benchmarks.md), not the broker
            # while RocksDB compacts.
            async with asyncio.TaskGroup() as probes:
                async for sent_at in paced(PROBE_RATE, lambda: not probing):
                    probes.create_task(one_probe(sent_at))
            probes_answered.set()  # every probe sent was answered and counted

        before = rocksdb_events(server)
        # The burst gets its own TCP connections so its 256 KiB frames do not queue
        # in front of the probe's on a shared HTTP/2 connection.
        conns = open_connections(server.addr, BURST_CONNECTIONS)
        try:
            async with background(probe()):
                ctx.status(f"baseline probe {p.compaction_baseline_s:g}s")
                await asyncio.sleep(p.compaction_baseline_s)
                burst_start = time.perf_counter()
                mib = p.burst_messages * p.burst_payload / 2**20
                ctx.status(
                    f"burst of {p.burst_messages:,} x {p.burst_payload // 1024} KiB "
                    f"({mib:,.0f} MiB)"
                )
                await preload(
                    conns,
                    BURST_PRODUCERS,
                    "burst",
                    p.burst_messages,
                    deadline_s=p.deadline_s,
                    payload=os.urandom(p.burst_payload),
                )
                burst_written = time.perf_counter()
                ctx.status("probing while RocksDB flushes and compacts after the burst")
                await _settle(server)
                burst_end = time.perf_counter()
                probing = False
                await asyncio.wait_for(probes_answered.wait(), p.deadline_s)
        finally:
            await close_all(conns)
        after = rocksdb_events(server)

    # `burst` is the whole window (as before); `writing` only while the burst is being
    # written, `settling` only after it, while RocksDB still flushes and compacts.
    baseline, burst, writing, settling = histogram(), histogram(), histogram(), histogram()
    for sent_at, micros in samples:
        value = max(1, int(micros))
        if sent_at < burst_start:
            baseline.record_value(value)
        elif sent_at < burst_end:
            burst.record_value(value)
            (writing if sent_at < burst_written else settling).record_value(value)
    # Reported, not gated: tails of a few hundred probes on a shared host vary by
    # more than any useful threshold (docs/benchmarks.md, "Noise and the gate").
    results = [
        latency_ms("compaction_p99_baseline_ms", percentile_ms(baseline, 99.0), gated=False),
        latency_ms("compaction_p99_burst_ms", percentile_ms(burst, 99.0), gated=False),
        latency_ms("compaction_p99_while_writing_ms", percentile_ms(writing, 99.0), gated=False),
        latency_ms("compaction_p99_after_burst_ms", percentile_ms(settling, 99.0), gated=False),
        Result(
            "compaction_after_burst_probes",
            settling.get_total_count(),
            COUNT,
            higher_is_better=True,
            gated=False,
        ),
    ]
    if before is not None and after is not None:
        compactions = after["compaction_started"] - before["compaction_started"]
        flushes = after["flush_started"] - before["flush_started"]
        moves = after["trivial_move"] - before["trivial_move"]
        results += [
            Result("compaction_flushes", flushes, COUNT, higher_is_better=False, gated=False),
            Result("compaction_runs", compactions, COUNT, higher_is_better=False, gated=False),
            # Tables moved down a level without a rewrite: what a burst costs when its
            # keys overlap nothing stored (fila.storage.keys).
            Result("compaction_trivial_moves", moves, COUNT, higher_is_better=True, gated=False),
        ]
    return results


async def _settle(server: ServerProcess) -> None:
    """Waits at least a second, then until no compaction is running (at most SETTLE_MAX_S).

    A flush or compaction the burst caused usually starts after its last write, so
    the probe keeps measuring through it.
    """
    deadline = time.perf_counter() + SETTLE_MAX_S
    await asyncio.sleep(1.0)
    while time.perf_counter() < deadline:
        events = rocksdb_events(server)
        if events is None or events["compaction_started"] == events["compaction_finished"]:
            return
        await asyncio.sleep(0.2)


CASES = [
    Case("rss", ("rss_idle_mib", "rss_load_mib"), _rss),
    Case(
        "compaction",
        (
            "compaction_p99_baseline_ms",
            "compaction_p99_burst_ms",
            "compaction_p99_while_writing_ms",
            "compaction_p99_after_burst_ms",
            "compaction_after_burst_probes",
            "compaction_flushes",
            "compaction_runs",
            "compaction_trivial_moves",
        ),
        _compaction,
        # these need RocksDB's LOG
        optional=("compaction_flushes", "compaction_runs", "compaction_trivial_moves"),
    ),
]
