"""Cluster mode (SPEC 9): what forwarding costs, and how long a killed owner's queues
are away when it is restarted at once.

Both cases run a real etcd (Debian's etcd-server, one member on free ports) and three
`fila-server` nodes in sync mode, each on its own data directory.

- Forwarding: one queue, owned by node 1. The same closed-loop enqueue load (8
  producers on 8 connections, 1 KB) goes alternately to the owner and to node 2, which
  forwards every call to node 1; slices alternate so that both paths see the same
  host. One producer with one call in flight gives the per-call view (p50 latency):
  the hop costs a second gRPC round trip and a second process's CPU. Every answered
  id must be in the queue afterwards (read through node 3).
- Recovery: node 1 is killed with SIGKILL and started again at once, as a supervisor
  would; the figure is the time from the kill until an enqueue to its queue succeeds
  through node 2 (the median of several kills). It covers the process start and
  recovery, rejoining etcd (the restarted node revokes its predecessor's lease instead
  of waiting for it to expire, see fila.cluster.identity) and node 2 learning that node
  1 is back. Nothing acknowledged before a kill may be missing after it.

None of these figures is gated yet: their run-to-run spread has not been measured
(scripts/bench-spread.sh), and a three-node cluster on a shared two-core host is
noisier than one broker.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fila.testing.children import free_port
from fila.testing.etcd import EtcdCluster
from fila.testing.server import ServerProcess
from fila_bench.case import Case, Context
from fila_bench.conn import close_all, open_connections
from fila_bench.cpus import pin_process
from fila_bench.load import PAYLOAD_1KB, CheckFailed, enqueue_for, histogram, percentile_ms
from fila_bench.results import MSG_S, PCT, Result, latency_ms
from fila_sdk import AsyncClient, FilaError

NODES = 3
PRODUCERS = 8
SLICES = 3  # owner and forwarded windows, alternating, each measure_s / SLICES long
SINGLE_CALLS = 400  # one in flight: per-call latency through each path
QUEUE = "cluster"
LEASE_TTL_MS = 5000  # the default: recovery does not depend on it (the lease is revoked)
RECOVERY_DEADLINE_S = 60.0
ATTEMPT_S = 5.0

FORWARD_OUTPUTS = (
    "cluster_enqueue_owner_8c",
    "cluster_enqueue_forwarded_8c",
    "cluster_forwarding_cost_pct",
    "cluster_enqueue_owner_p50",
    "cluster_enqueue_forwarded_p50",
)
RECOVERY_OUTPUTS = ("cluster_recovery_ms",)


@asynccontextmanager
async def started_cluster(
    ctx: Context,
    name: str,
    *,
    lease_ttl_ms: int = LEASE_TTL_MS,
    settings: Callable[[int], str] | None = None,
) -> AsyncIterator[list[ServerProcess]]:
    """etcd and three started nodes, all stopped (and their data removed) on exit;
    `settings(node_id)`: more `[cluster]` lines for that node."""
    root = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=ctx.workdir))
    etcd = EtcdCluster(root / "etcd")
    nodes: list[ServerProcess] = []
    try:
        await asyncio.to_thread(etcd.start)
        for node_id in range(1, NODES + 1):
            port = free_port()
            config = (
                f'[cluster]\nnode_id = {node_id}\nadvertise_addr = "127.0.0.1:{port}"\n'
                f'etcd_endpoints = ["{etcd.endpoints[0]}"]\nlease_ttl_ms = {lease_ttl_ms}\n'
                + (settings(node_id) if settings is not None else "")
            )
            node = ServerProcess(
                root / f"node{node_id}" / "data", config_toml=config, persist_mode="sync", port=port
            )
            nodes.append(node)
            await asyncio.to_thread(node.start)
            pin(ctx, node)
        yield nodes
    finally:
        for node in nodes:
            if node.running:
                await asyncio.to_thread(node.stop)
        await asyncio.to_thread(etcd.stop)
        await asyncio.to_thread(shutil.rmtree, root, True)


def pin(ctx: Context, node: ServerProcess) -> None:
    if ctx.placement is not None:
        pin_process(node.pid, ctx.placement.server)


async def _forwarding(ctx: Context) -> list[Result]:
    p = ctx.profile
    async with started_cluster(ctx, "cluster-forwarding") as nodes:
        owner, other, reader = nodes
        async with AsyncClient(owner.addr) as admin:
            await admin.create_queue(QUEUE)  # the first queue goes to node 1 (fewest, lowest)
        paths = {"owner": owner.addr, "forwarded": other.addr}
        rates: dict[str, list[float]] = {path: [] for path in paths}
        answered: list[str] = []
        for index in range(SLICES):
            for path, addr in paths.items():
                ctx.status(f"enqueue through the {path}, window {index + 1} of {SLICES}")
                conns = open_connections(addr, PRODUCERS)
                try:
                    run = await enqueue_for(
                        conns,
                        PRODUCERS,
                        QUEUE,
                        warmup_s=p.warmup_s,
                        measure_s=p.measure_s / SLICES,
                    )
                finally:
                    await close_all(conns)
                rates[path].append(run.rate)
                answered += run.ids
        p50: dict[str, float] = {}
        for path, addr in paths.items():
            ctx.status(f"one call in flight through the {path}")
            hist = histogram()
            async with AsyncClient(addr) as client:
                for _ in range(SINGLE_CALLS):
                    started = time.perf_counter()
                    answered.append(await client.enqueue(QUEUE, None, PAYLOAD_1KB))
                    hist.record_value(max(1, int((time.perf_counter() - started) * 1e6)))
            p50[path] = percentile_ms(hist, 50)
        async with AsyncClient(reader.addr) as client:
            depth = (await client.get_stats(QUEUE)).depth
    owner_rate = statistics.mean(rates["owner"])
    forwarded_rate = statistics.mean(rates["forwarded"])
    results = [
        _rate("cluster_enqueue_owner_8c", owner_rate),
        _rate("cluster_enqueue_forwarded_8c", forwarded_rate),
        Result(
            "cluster_forwarding_cost_pct",
            100.0 * (owner_rate - forwarded_rate) / owner_rate,
            PCT,
            higher_is_better=False,
            gated=False,  # the difference of two noisy rates
        ),
        latency_ms("cluster_enqueue_owner_p50", p50["owner"], gated=False),
        latency_ms("cluster_enqueue_forwarded_p50", p50["forwarded"], gated=False),
    ]
    if depth != len(answered):
        raise CheckFailed(
            f"cluster_forwarding: {len(answered)} enqueues answered, the queue holds {depth}",
            results,
        )
    return results


def _rate(name: str, msg_per_s: float) -> Result:
    return Result(name, msg_per_s, MSG_S, higher_is_better=True, gated=False)


async def _recovery(ctx: Context) -> list[Result]:
    kills = 2 if ctx.profile.name == "quick" else 5
    async with started_cluster(ctx, "cluster-recovery") as nodes:
        owner, other, _reader = nodes
        timings: list[float] = []
        async with AsyncClient(owner.addr) as admin:
            await admin.create_queue(QUEUE)
        async with AsyncClient(other.addr) as client:
            acknowledged = [await client.enqueue(QUEUE, None, PAYLOAD_1KB) for _ in range(100)]
            for kill in range(kills):
                ctx.status(f"kill -9 of the owner, {kill + 1} of {kills}")
                killed_at = time.perf_counter()
                owner.kill()
                restart = asyncio.create_task(asyncio.to_thread(owner.start))
                try:
                    acknowledged.append(await _first_success(client, killed_at))
                finally:
                    await restart
                pin(ctx, owner)
                timings.append((time.perf_counter() - killed_at) * 1000)
            depth = (await client.get_stats(QUEUE)).depth
    results = [latency_ms("cluster_recovery_ms", statistics.median(timings), gated=False)]
    if depth != len(acknowledged):
        raise CheckFailed(
            f"cluster_recovery: {len(acknowledged)} enqueues acknowledged, {depth} in the "
            "queue after the restarts",
            results,
        )
    return results


async def _first_success(client: AsyncClient, since: float) -> str:
    """Enqueues through a non-owner until one succeeds; the answered id. An attempt
    not answered within ATTEMPT_S is given up and made again (its time counts), so
    one lost answer cannot stall the run."""
    while (left := RECOVERY_DEADLINE_S - (time.perf_counter() - since)) > 0:
        try:
            return await asyncio.wait_for(
                client.enqueue(QUEUE, None, PAYLOAD_1KB), min(ATTEMPT_S, left)
            )
        except TimeoutError:
            pass  # not answered in time: give this attempt up and make another
        except FilaError:
            await asyncio.sleep(0.005)  # the owner is still away: try again shortly
    raise TimeoutError(f"the owner's queue did not answer within {RECOVERY_DEADLINE_S}s")


CASES = [
    Case("cluster_forwarding", FORWARD_OUTPUTS, _forwarding),
    Case("cluster_recovery", RECOVERY_OUTPUTS, _recovery),
]
