"""Replication (SPEC 9, "Replication"; docs/cluster.md): what a replicated write costs
against an unreplicated one in the same run, how long a killed leader's queue is away,
and how fast a follower catches up.

Every case runs a real etcd (one member) and three `fila-server` nodes in sync mode on
this machine (`fila_bench.benchmarks.cluster.started_cluster`).

- `replication_enqueue`: nodes 1 and 3 have `replication_factor = 3`, node 2 has 1, so
  one cluster holds both kinds of queue: `r3`, created first, is placed on node 1 and
  replicated on all three nodes; `r1`, created next, is placed on node 2 (the node
  leading the fewest) and held by it alone. Durable enqueues (1 KB) go to each queue's
  leader in alternating windows (`SLICES` of each, one with `--quick`), so both see
  the same host: 50
  connections with one call in flight each (`_50c`), and one SDK client with
  `SDK_CALLS` concurrent `enqueue` calls, which it coalesces on one `StreamEnqueue`
  stream (`_sdk`). The replicated queue's writers wait for two more fsyncs, on two
  more processes that share the same two cores. Every answered id must be stored.
- `replication_failover`: `lease_ttl_ms` = `FAILOVER_TTL_MS` (etcd's minimum, so the
  case is short; the goal scales with it: within the TTL + 1 s). The leader of a
  replicated queue is killed with SIGKILL; the figure is the time from the kill to the
  first enqueue answered through another node, which retries (each attempt given up
  after `ATTEMPT_S`). The killed node is started again and the next kill waits until
  all three replicas are in sync. Median and worst of several kills; every answered
  enqueue must be stored afterwards.
- `replication_catchup`: a follower is stopped, `catchup_messages` (1 KB) are enqueued
  without it, and it is started again: the time from its start until the leader lists
  it in sync gives the rate at which it caught up from the leader's log. Then it is
  stopped, its data directory wiped, and started again: the whole queue comes as a
  snapshot, and the same time gives the snapshot's rate. Both include the follower's
  subscription and fsyncs, not its process start (the clock starts once it serves).

None is gated: their run-to-run spread on a shared two-core host has not been
measured; `docs/benchmarks.md` ("Replication") has the figures and commands.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import time

import grpc

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc
from fila_bench.benchmarks.cluster import pin, started_cluster
from fila_bench.case import Case, Context
from fila_bench.conn import Connection, close_all, open_connections
from fila_bench.load import PAYLOAD_1KB, CheckFailed, enqueue_for, preload
from fila_bench.results import MSG_S, RATIO, Result, latency_ms
from fila_sdk import AsyncClient, FilaError

SLICES = 3
CONNECTIONS = 50
SDK_CALLS = 256  # concurrent enqueues on one client: the SDK batches them on its stream
FAILOVER_TTL_MS = 2000
ATTEMPT_S = 1.0
DEADLINE_S = 60.0
POLL_S = 0.02
CATCHUP_MESSAGES = {"quick": 3_000, "full": 20_000}  # within the 64 MiB log

ENQUEUE_OUTPUTS = (
    "replication_enqueue_rf1_50c",
    "replication_enqueue_rf3_50c",
    "replication_rf3_over_rf1_50c",
    "replication_enqueue_rf1_sdk",
    "replication_enqueue_rf3_sdk",
    "replication_rf3_over_rf1_sdk",
)
FAILOVER_OUTPUTS = ("replication_failover_ms", "replication_failover_max_ms")
CATCHUP_OUTPUTS = (
    "replication_catchup_log_msg_s",
    "replication_catchup_log_mb_s",
    "replication_catchup_snapshot_msg_s",
    "replication_catchup_snapshot_mb_s",
)


def _factor(node_id: int) -> str:
    return f"replication_factor = {1 if node_id == 2 else 3}\n"


def _all_three(node_id: int) -> str:
    return "replication_factor = 3\n"


async def _stats(addr: str, queue: str) -> admin_pb2.GetStatsResponse:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = admin_pb2_grpc.FilaAdminStub(channel)
        reply: admin_pb2.GetStatsResponse = await stub.GetStats(
            admin_pb2.GetStatsRequest(queue=queue), timeout=10
        )
        return reply


async def _until_in_sync(addr: str, queue: str, members: int, since: float) -> float:
    """Seconds from `since` until `queue`'s leader (asked through `addr`) lists
    `members` replicas in sync."""
    while time.perf_counter() - since < DEADLINE_S:
        try:
            if len((await _stats(addr, queue)).in_sync_node_ids) == members:
                return time.perf_counter() - since
        except grpc.aio.AioRpcError:
            pass  # no leader for a moment: ask again
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"{queue}: {members} replicas not in sync within {DEADLINE_S}s")


# -- replicated against unreplicated enqueue --------------------------------------------


async def _enqueue(ctx: Context) -> list[Result]:
    p = ctx.profile
    async with started_cluster(ctx, "replication-enqueue", settings=_factor) as nodes:
        async with AsyncClient(nodes[0].addr) as admin:
            await admin.create_queue("r3")
            await admin.create_queue("r1")
        leaders = {"r3": nodes[0].addr, "r1": nodes[1].addr}
        for queue, copies in (("r3", 3), ("r1", 1)):
            stats = await _stats(leaders[queue], queue)
            if stats.replication_count != copies:
                raise CheckFailed(f"{queue}: {stats.replication_count} in sync, not {copies}")
        rates: dict[str, list[float]] = {}
        answered: dict[str, int] = {"r1": 0, "r3": 0}
        slices = 1 if p.name == "quick" else SLICES
        for index in range(slices):
            for cell in ("50c", "sdk"):
                for queue in ("r1", "r3"):
                    ctx.status(f"{queue}, {cell}, window {index + 1} of {slices}")
                    count = CONNECTIONS if cell == "50c" else 1
                    conns: list[Connection] = list(open_connections(leaders[queue], count))
                    producers = CONNECTIONS if cell == "50c" else SDK_CALLS
                    try:
                        run = await enqueue_for(
                            conns,
                            producers,
                            queue,
                            warmup_s=p.warmup_s,
                            measure_s=p.measure_s / slices,
                        )
                    finally:
                        await close_all(conns)
                    rates.setdefault(f"{queue}_{cell}", []).append(run.rate)
                    answered[queue] += len(run.ids)
        for queue, count in answered.items():
            depth = (await _stats(leaders[queue], queue)).depth
            if depth != count:
                raise CheckFailed(f"{queue}: {count} enqueues answered, the queue holds {depth}")
    results: list[Result] = []
    for cell in ("50c", "sdk"):
        rf1 = statistics.median(rates[f"r1_{cell}"])
        rf3 = statistics.median(rates[f"r3_{cell}"])
        results += [
            Result(
                f"replication_enqueue_rf1_{cell}", rf1, MSG_S, higher_is_better=True, gated=False
            ),
            Result(
                f"replication_enqueue_rf3_{cell}", rf3, MSG_S, higher_is_better=True, gated=False
            ),
            Result(
                f"replication_rf3_over_rf1_{cell}",
                rf3 / rf1 if rf1 else 0.0,
                RATIO,
                higher_is_better=True,
                gated=False,
            ),
        ]
    return results


# -- failover -------------------------------------------------------------------------


async def _leader(nodes: list[ServerProcess], queue: str) -> int:
    for node in nodes:
        if node.running:
            with_leader = (await _stats(node.addr, queue)).leader_node_id
            if with_leader:
                return int(with_leader)
    raise CheckFailed(f"{queue}: no node names a leader")


async def _first_answer(client: AsyncClient, queue: str, since: float) -> str:
    """Enqueues until one is answered; the answered id. An attempt not answered within
    ATTEMPT_S (forwarded to the dead leader) is given up and made again."""
    while time.perf_counter() - since < DEADLINE_S:
        try:
            return await asyncio.wait_for(client.enqueue(queue, None, PAYLOAD_1KB), ATTEMPT_S)
        except TimeoutError:
            pass  # not answered in time: give this attempt up and make another
        except FilaError:
            await asyncio.sleep(0.005)  # no leader yet: try again shortly
    raise TimeoutError(f"{queue} did not answer within {DEADLINE_S}s of the kill")


async def _failover(ctx: Context) -> list[Result]:
    kills = 2 if ctx.profile.name == "quick" else 5
    timings: list[float] = []
    async with started_cluster(
        ctx, "replication-failover", lease_ttl_ms=FAILOVER_TTL_MS, settings=_all_three
    ) as nodes:
        async with AsyncClient(nodes[0].addr) as admin:
            await admin.create_queue("fo")
        answered = 0
        for kill in range(kills):
            leader = await _leader(nodes, "fo")
            entry = nodes[leader % len(nodes)]  # another node, which stays up
            async with AsyncClient(entry.addr) as client:
                for _ in range(20):
                    await client.enqueue("fo", None, PAYLOAD_1KB)
                answered += 20
                ctx.status(f"kill -9 of the leader (node {leader}), {kill + 1} of {kills}")
                killed_at = time.perf_counter()
                nodes[leader - 1].kill()
                await _first_answer(client, "fo", killed_at)
                timings.append((time.perf_counter() - killed_at) * 1000)
                answered += 1
            await asyncio.to_thread(nodes[leader - 1].start)
            pin(ctx, nodes[leader - 1])
            await _until_in_sync(entry.addr, "fo", 3, time.perf_counter())
        depth = (await _stats(nodes[0].addr, "fo")).depth
    results = [
        latency_ms("replication_failover_ms", statistics.median(timings), gated=False),
        latency_ms("replication_failover_max_ms", max(timings), gated=False),
    ]
    if depth != answered:
        raise CheckFailed(
            f"failover: {answered} enqueues answered, the queue holds {depth}", results
        )
    return results


# -- catch-up -------------------------------------------------------------------------


async def _catchup(ctx: Context) -> list[Result]:
    p = ctx.profile
    count = CATCHUP_MESSAGES["quick" if p.name == "quick" else "full"]
    mb = count * len(PAYLOAD_1KB) / 1e6
    async with started_cluster(
        ctx, "replication-catchup", lease_ttl_ms=FAILOVER_TTL_MS, settings=_all_three
    ) as nodes:
        leader, _, follower = nodes
        async with AsyncClient(leader.addr) as admin:
            await admin.create_queue("cu")
        await _until_in_sync(leader.addr, "cu", 3, time.perf_counter())

        async def behind() -> None:
            ctx.status(f"{count} messages while node 3 is stopped")
            await asyncio.to_thread(follower.stop)
            await _until_in_sync(leader.addr, "cu", 2, time.perf_counter())
            conns: list[Connection] = list(open_connections(leader.addr, 1))
            try:
                await preload(conns, SDK_CALLS, "cu", count, deadline_s=p.deadline_s)
            finally:
                await close_all(conns)

        await behind()
        ctx.status("node 3 catching up from the log")
        await asyncio.to_thread(follower.start)
        pin(ctx, follower)
        log_s = await _until_in_sync(leader.addr, "cu", 3, time.perf_counter())
        await behind()
        await asyncio.to_thread(shutil.rmtree, follower.data_dir)
        ctx.status("node 3, wiped, catching up from a snapshot")
        await asyncio.to_thread(follower.start)
        pin(ctx, follower)
        snapshot_s = await _until_in_sync(leader.addr, "cu", 3, time.perf_counter())
        depth = (await _stats(leader.addr, "cu")).depth
    if depth != 2 * count:
        raise CheckFailed(f"catch-up: {2 * count} enqueues answered, the queue holds {depth}")
    return [
        Result(
            "replication_catchup_log_msg_s",
            count / log_s,
            MSG_S,
            higher_is_better=True,
            gated=False,
        ),
        Result(
            "replication_catchup_log_mb_s", mb / log_s, "MB/s", higher_is_better=True, gated=False
        ),
        Result(
            "replication_catchup_snapshot_msg_s",
            2 * count / snapshot_s,
            MSG_S,
            higher_is_better=True,
            gated=False,
        ),
        Result(
            "replication_catchup_snapshot_mb_s",
            2 * mb / snapshot_s,
            "MB/s",
            higher_is_better=True,
            gated=False,
        ),
    ]


CASES = [
    Case("replication_enqueue", ENQUEUE_OUTPUTS, _enqueue),
    Case("replication_failover", FAILOVER_OUTPUTS, _failover),
    Case("replication_catchup", CATCHUP_OUTPUTS, _catchup),
]
