"""Replicated queues (SPEC 9, "Replication"; docs/cluster.md) against real processes:
etcd from Debian's package and three or four `fila-server` nodes with
`replication_factor = 3`, network namespaces where a link must be cut.

What is shown here:
- a queue created with replication_factor 3 is held by three nodes, answers once
  they are in sync, and every node lists its leader, replicas and in-sync set;
- `kill -9` of the leader under 20 producers and 4 consumers: nothing answered is
  lost, no answered ack comes back, and enqueues are answered again within
  `lease_ttl_ms` + 1 s (a short run of `scripts/crash_soak.py --cluster`);
- a leader paused (SIGSTOP) for twice its lease under load: nothing it acknowledged
  is lost, and it acknowledges nothing once it resumes;
- after each of these, every replica holds exactly the leader's records (no
  divergent entry), read from the nodes' disks once they are stopped.

The protocol's rules one by one are specified in-process (tests/test_replication_protocol.py).
Marked `cluster`: deselect with `-m "not cluster"`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from support import wait_until
from support.cluster import LEASE_TTL_MS, Cluster
from support.replication import leader, queue_info, replicated_cluster, stored, wait_in_sync

from fila.testing.soak import Ledger, Targets, consume, produce
from fila.v1 import admin_pb2, service_pb2

pytestmark = pytest.mark.cluster

TTL_S = LEASE_TTL_MS / 1000
FAILOVER_GOAL_S = TTL_S + 1


def _same_on_every_replica(made: Cluster, queue: str) -> None:
    """Stops every node and compares what their disks hold of `queue`."""
    for proc in made.nodes.values():
        if proc.running:
            proc.stop()
    seen = {node_id: stored(proc.data_dir, queue) for node_id, proc in made.nodes.items()}
    records = {node_id: found[0] for node_id, found in seen.items()}
    first = next(iter(records.values()))
    assert first, f"no node holds {queue}"
    for node_id, held in records.items():
        assert held == first, f"node {node_id} holds another state of {queue}"
    # The same last batch (a node elected as the others stopped starts an epoch of
    # its own, with no batch in it).
    positions = {node_id: found[1] for node_id, found in seen.items()}
    assert len({(p.seq, p.epoch) for p in positions.values() if p}) == 1, positions


def _stored_ids(made: Cluster, via: int, queue: str) -> set[str]:
    """Every message id `queue` holds (ready, delayed or leased), paging through peek."""
    admin = made.admin(via)
    ids: set[str] = set()
    after = ""
    while True:
        page = admin.PeekMessages(
            admin_pb2.PeekMessagesRequest(queue=queue, limit=1000, after_id=after), timeout=10
        )
        ids |= {m.id for m in page.messages}
        if not page.next_after_id:
            return ids
        after = page.next_after_id


def test_a_replicated_queue_is_held_by_three_nodes_and_moves_when_its_leader_dies(
    tmp_path: Path,
) -> None:
    with replicated_cluster(tmp_path) as made:
        fila = made.fila(2)
        fila.create_queue("orders")  # answered once every replica is in sync
        first = leader(made, "orders", 1)
        for via in (1, 2, 3):
            info = queue_info(made, "orders", via)
            assert info is not None
            assert (info.leader_node_id, info.replication_count) == (first, 3)
            assert info.replica_node_ids[0] == first
            assert set(info.replica_node_ids) == set(info.in_sync_node_ids) == {1, 2, 3}
            stats = made.fila(via).stats("orders")  # forwarded to the leader
            assert (stats.leader_node_id, stats.replication_count) == (first, 3)
        sent = [fila.enqueue("orders", b"%d" % i) for i in range(20)]
        with made.fila(first).consume("orders") as stream:
            leased = [m.id for m in stream.take(3)]
        fila.ack("orders", leased[0])
        fila.nack("orders", leased[1], "retry")

        made.node(first).kill()
        killed_at = time.monotonic()
        entry = next(n for n in (1, 2, 3) if n != first)

        def answered() -> str:
            try:
                return made.fila(entry).enqueue("orders", b"after")
            except grpc.RpcError:
                return ""

        wait_until(answered, FAILOVER_GOAL_S + 5, what="an enqueue answered after the kill")
        took = time.monotonic() - killed_at
        assert took <= FAILOVER_GOAL_S, f"answered again {took:.2f}s after the kill"
        now_leading = leader(made, "orders", entry)
        assert now_leading != first
        info = queue_info(made, "orders", entry)
        assert info is not None and set(info.in_sync_node_ids) == {1, 2, 3} - {first}
        # Everything answered is there: 19 ready or leased (one acked), one more after.
        peek = made.fila(entry).admin.PeekMessages(
            admin_pb2.PeekMessagesRequest(queue="orders", limit=100)
        )
        kept = [m.id for m in peek.messages]
        assert kept[:19] == [m for m in sent if m != leased[0]]
        assert len(kept) == 20

        made.node(first).start()  # back as a follower: it catches up and is in sync again
        wait_in_sync(made, "orders", entry, {1, 2, 3}, 20)
        assert leader(made, "orders", first) == now_leading
        _same_on_every_replica(made, "orders")


async def _soak_leader_kills(made: Cluster, cycles: int) -> dict[str, object]:
    addresses = [made.node(n).addr for n in sorted(made.nodes)]
    ledger = Ledger()
    targets = Targets(addresses)
    stop_producing, stop_consuming = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(produce(targets, "soak", ledger, stop_producing, i % 3))
        for i in range(20)
    ] + [
        asyncio.create_task(consume(targets, "soak", ledger, stop_consuming, i % 3))
        for i in range(4)
    ]
    failovers: list[float] = []
    try:
        for _ in range(cycles):
            await _until(lambda: len(ledger.answered_enqueues) > 300, "load", 30)
            victim = await asyncio.to_thread(leader, made, "soak", 1)
            killed_at = time.monotonic()
            await asyncio.to_thread(made.node(victim).kill)
            await _until(
                lambda at=killed_at: ledger.first_answer_after(at) is not None,  # type: ignore[misc]
                "an enqueue answered after the kill",
                30,
            )
            answered = ledger.first_answer_after(killed_at)
            assert answered is not None
            failovers.append(answered - killed_at)
            await asyncio.to_thread(made.node(victim).start)
        stop_producing.set()

        def drained() -> bool:
            stats = made.fila(1).stats("soak")
            return (stats.depth, stats.in_flight) == (0, 0)

        await asyncio.to_thread(wait_until, drained, 60, what="the queue drained")
        stop_consuming.set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await targets.close()
    return {**ledger.verdict(), "failovers": failovers}


async def _until(predicate: object, what: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen within {within}s")
        await asyncio.sleep(0.05)  # polling the ledger with a deadline


def test_kill9_of_the_leader_under_load_loses_nothing_and_is_over_within_the_lease(
    tmp_path: Path,
) -> None:
    """20 producers and 4 consumers on every path; the leader of the queue killed twice
    (the ten-kill loop is `scripts/crash_soak.py --cluster`)."""
    with replicated_cluster(tmp_path) as made:
        made.admin(1).CreateQueue(
            admin_pb2.CreateQueueRequest(
                name="soak", config=admin_pb2.QueueConfig(visibility_timeout_ms=2000)
            ),
            timeout=20,
        )
        report = asyncio.run(_soak_leader_kills(made, cycles=2))
        print(f"kill -9 of the leader under load: {report}")
        assert (report["lost"], report["duplicated"], report["resurrected"]) == (0, 0, 0)
        assert report["answered_enqueues"] and report["answered_acks"]
        failovers = report["failovers"]
        assert isinstance(failovers, list)
        assert max(failovers) <= FAILOVER_GOAL_S, failovers
        wait_in_sync(made, "soak", 1, {1, 2, 3}, 20)
        _same_on_every_replica(made, "soak")


def test_a_leader_paused_for_twice_its_lease_acknowledges_nothing_after_the_pause(
    tmp_path: Path,
) -> None:
    with replicated_cluster(tmp_path) as made:
        made.fila(1).create_queue("paused")
        first = leader(made, "paused", 1)
        answers: list[tuple[float, int, str]] = []  # (when, node asked, message id)
        stop = threading.Event()

        def producer(via: int) -> None:
            client = made.fila(via)
            while not stop.is_set():
                try:
                    reply = client.svc.Enqueue(
                        service_pb2.EnqueueRequest(queue="paused", payload=b"p"), timeout=10
                    )
                except grpc.RpcError:
                    time.sleep(0.02)  # retry pacing
                    continue
                answers.append((time.monotonic(), via, reply.message_id))

        threads = [threading.Thread(target=producer, args=(via,), daemon=True) for via in (1, 2, 3)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(answers) > 50, 20, what="answers before the pause")
        os.kill(made.node(first).pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            time.sleep(2 * TTL_S)  # the pause itself is what is tested
        finally:
            os.kill(made.node(first).pid, signal.SIGCONT)
        resumed_at = time.monotonic()
        wait_until(lambda: any(t > resumed_at + 1 for t, _, _ in answers), 20, what="answers")
        stop.set()
        for thread in threads:
            thread.join(15)
        late = [
            (round(t - stopped_at, 2), via)
            for t, via, _ in answers
            if via == first and t > resumed_at
        ]
        # Answers through the paused node after it resumed were forwarded to the new
        # leader; none was the paused node's own (they are all in the new leader's queue).
        now_leading = leader(made, "paused", next(n for n in (1, 2, 3) if n != first))
        assert now_leading != first
        answered = {mid for _, _, mid in answers}
        kept = _stored_ids(made, now_leading, "paused")
        assert answered <= kept, f"{len(answered - kept)} answered enqueues are lost"
        print(f"paused leader: {len(answered)} answered, {len(late)} through it after it resumed")
        wait_in_sync(made, "paused", now_leading, {1, 2, 3}, 20)
        _same_on_every_replica(made, "paused")
