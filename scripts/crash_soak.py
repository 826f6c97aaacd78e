#!/usr/bin/env python3
"""Crash soak: kill -9 brokers again and again under load, then count what broke.

    python scripts/crash_soak.py [--cycles 20] [--producers 50] [--consumers 50]
    python scripts/crash_soak.py --cluster [--cycles 10] [--producers 20] [--consumers 4]

The load and the verdict are `fila.testing.soak`'s: producers remember which
enqueues were answered, consumers which acks were; at the end the queue is drained
and these are counted:

- lost: an answered enqueue that was never delivered (sync mode promises none);
- duplicated: one tag stored under two message ids (the broker stored a message twice);
- resurrected: a message delivered again after its ack was answered.

One node: every cycle runs the load for a random 0.5-2.5 s, SIGKILLs the broker, and
starts it again on the same data directory.

`--cluster`: three nodes and an etcd member, the queue created with
`replication_factor = 3`. Every cycle runs the load for a random while, SIGKILLs the
queue's leader, measures how long until an enqueue is answered again (the failover:
the goal is within `lease_ttl_ms` + 1 s), and starts the killed node again once it
has been replaced, so the next cycle kills a leader that was elected.

Exits 1 unless lost, duplicated and resurrected are all 0 (and, with --cluster,
every failover was within its goal). Not part of the test suite: it takes minutes
(tests/test_replication.py runs a short version of the cluster mode).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc

from fila.testing.etcd import EtcdCluster
from fila.testing.server import ServerProcess
from fila.testing.soak import Ledger, Targets, consume, produce
from fila.v1 import admin_pb2, admin_pb2_grpc

QUEUE = "soak"
LEASE_TTL_MS = 2000


async def _create(addr: str) -> None:
    async with grpc.aio.insecure_channel(addr) as channel:
        await admin_pb2_grpc.FilaAdminStub(channel).CreateQueue(
            admin_pb2.CreateQueueRequest(
                name=QUEUE, config=admin_pb2.QueueConfig(visibility_timeout_ms=2000)
            ),
            timeout=20,
        )


async def _stats(addr: str) -> admin_pb2.GetStatsResponse:
    async with grpc.aio.insecure_channel(addr) as channel:
        return await admin_pb2_grpc.FilaAdminStub(channel).GetStats(
            admin_pb2.GetStatsRequest(queue=QUEUE), timeout=10, wait_for_ready=True
        )


async def _drain(addresses: list[str], stop_consuming: asyncio.Event) -> None:
    """Until the queue is empty (polling with a deadline), then stops the consumers."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for addr in addresses:
            try:
                stats = await _stats(addr)
            except grpc.aio.AioRpcError:
                continue
            if (stats.depth, stats.in_flight) == (0, 0):
                stop_consuming.set()
                return
            break
        await asyncio.sleep(0.2)  # polling the drain with a deadline
    stop_consuming.set()


def _start_load(
    targets: Targets, ledger: Ledger, producers: int, consumers: int
) -> tuple[list[asyncio.Task[None]], asyncio.Event, asyncio.Event]:
    stop_producing, stop_consuming = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(produce(targets, QUEUE, ledger, stop_producing, i % 3))
        for i in range(producers)
    ] + [
        asyncio.create_task(consume(targets, QUEUE, ledger, stop_consuming, i % 3))
        for i in range(consumers)
    ]
    return tasks, stop_producing, stop_consuming


async def soak(cycles: int, producers: int, consumers: int, workdir: Path) -> dict[str, object]:
    server = ServerProcess(workdir / "data", persist_mode="sync", config_toml="[server]\n")
    server.start()
    await _create(server.addr)
    ledger = Ledger()
    targets = Targets([server.addr], channels_per_node=8)
    tasks, stop_producing, stop_consuming = _start_load(targets, ledger, producers, consumers)
    rng = random.Random(7)
    try:
        for cycle in range(cycles):
            await asyncio.sleep(rng.uniform(0.5, 2.5))  # load runs for a random while
            await asyncio.to_thread(server.kill)
            await asyncio.to_thread(server.start)
            print(
                f"cycle {cycle + 1}/{cycles}: answered enqueues {len(ledger.answered_enqueues)}, "
                f"answered acks {len(ledger.acked_at)}",
                flush=True,
            )
        stop_producing.set()
        await _drain([server.addr], stop_consuming)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await targets.close()
        server.stop()
    return {"cycles": cycles, "producers": producers, "consumers": consumers, **ledger.verdict()}


def cluster_nodes(workdir: Path, etcd: EtcdCluster, count: int = 3) -> list[ServerProcess]:
    """`count` nodes of one cluster on `etcd`, with `replication_factor = count`."""
    from fila.testing.children import free_port

    nodes = []
    endpoints = ", ".join(f'"{e}"' for e in etcd.endpoints)
    for node_id in range(1, count + 1):
        port = free_port()
        config = (
            f'[cluster]\nnode_id = {node_id}\nadvertise_addr = "127.0.0.1:{port}"\n'
            f"etcd_endpoints = [{endpoints}]\nlease_ttl_ms = {LEASE_TTL_MS}\n"
            f"replication_factor = {count}\n"
        )
        nodes.append(
            ServerProcess(
                workdir / f"node{node_id}" / "data",
                persist_mode="sync",
                config_toml=config,
                port=port,
            )
        )
    return nodes


async def leader_of(addresses: list[str]) -> int:
    """The node id leading the queue, as the first node that answers says."""
    for addr in addresses:
        try:
            return int((await _stats(addr)).leader_node_id)
        except grpc.aio.AioRpcError:
            continue
    raise RuntimeError("no node answered GetStats")


async def soak_cluster(
    cycles: int, producers: int, consumers: int, workdir: Path, seed: int = 7
) -> dict[str, object]:
    etcd = EtcdCluster(workdir / "etcd").start()
    nodes = cluster_nodes(workdir, etcd)
    for node in nodes:
        node.start()
    addresses = [node.addr for node in nodes]
    await _create(addresses[0])
    ledger = Ledger()
    targets = Targets(addresses)
    tasks, stop_producing, stop_consuming = _start_load(targets, ledger, producers, consumers)
    rng = random.Random(seed)
    failovers: list[float] = []
    try:
        for cycle in range(cycles):
            await asyncio.sleep(rng.uniform(0.5, 2.5))  # load runs for a random while
            leader = await leader_of(addresses)
            killed_at = time.monotonic()
            await asyncio.to_thread(nodes[leader - 1].kill)
            deadline = killed_at + 30
            while (answered := ledger.first_answer_after(killed_at)) is None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no enqueue answered within 30 s of killing node {leader}")
                await asyncio.sleep(0.05)  # polling the ledger with a deadline
            failovers.append(answered - killed_at)
            await asyncio.to_thread(nodes[leader - 1].start)
            print(
                f"cycle {cycle + 1}/{cycles}: killed leader {leader}, answered again after "
                f"{failovers[-1]:.2f} s; answered enqueues {len(ledger.answered_enqueues)}, "
                f"answered acks {len(ledger.acked_at)}",
                flush=True,
            )
        stop_producing.set()
        await _drain(addresses, stop_consuming)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await targets.close()
        for node in nodes:
            if node.running:
                node.stop()
        etcd.stop()
    goal_s = LEASE_TTL_MS / 1000 + 1
    return {
        "cycles": cycles,
        "producers": producers,
        "consumers": consumers,
        **ledger.verdict(),
        "failover_s": [round(f, 3) for f in failovers],
        "failover_goal_s": goal_s,
        "failovers_over_goal": sum(1 for f in failovers if f > goal_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", action="store_true", help="three replicated nodes")
    parser.add_argument("--cycles", type=int, default=None, help="20 (--cluster: 10)")
    parser.add_argument("--producers", type=int, default=None, help="50 (--cluster: 20)")
    parser.add_argument("--consumers", type=int, default=None, help="50 (--cluster: 4)")
    parser.add_argument("--out", type=Path, help="also write the counts as JSON here")
    args = parser.parse_args()
    cycles = args.cycles or (10 if args.cluster else 20)
    producers = args.producers or (20 if args.cluster else 50)
    consumers = args.consumers or (4 if args.cluster else 50)
    with tempfile.TemporaryDirectory(prefix="fila-soak-") as tmp:
        run = soak_cluster if args.cluster else soak
        report = asyncio.run(run(cycles, producers, consumers, Path(tmp)))
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    failed = (
        report["lost"]
        or report["duplicated"]
        or report["resurrected"]
        or report.get("failovers_over_goal")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
