"""Helpers for the replication tests (tests/test_replication.py): a cluster whose nodes
replicate, who leads a queue, and what a stopped node holds of a queue on its disk."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc

from fila.cluster.replication.position import Position
from fila.storage import keys
from fila.storage.backend import RocksStorage
from fila.testing.etcd import EtcdCluster
from fila.v1 import admin_pb2, messages_pb2
from support import wait_until
from support.cluster import Cluster, require_etcd


def replicated(factor: int, extra: str = "") -> str:
    """A node's extra `[cluster]` settings for `replication_factor = factor`."""
    return f"replication_factor = {factor}\n{extra}"


@contextlib.contextmanager
def replicated_cluster(
    root: Path, nodes: int = 3, factor: int = 3, *, env: dict[str, str] | None = None
) -> Iterator[Cluster]:
    """One etcd member and `nodes` nodes replicating each new queue `factor` times."""
    require_etcd()
    etcd = EtcdCluster(root / "etcd").start()
    made = Cluster(root, etcd, env=env)
    try:
        for node_id in range(1, nodes + 1):
            made.add(node_id, extra=replicated(factor))
        yield made
    finally:
        made.close()


def queue_info(made: Cluster, queue: str, via: int) -> admin_pb2.QueueInfo | None:
    try:
        listed = made.admin(via).ListQueues(admin_pb2.ListQueuesRequest(), timeout=10)
    except grpc.RpcError:
        return None
    return next((info for info in listed.queues if info.name == queue), None)


def leader(made: Cluster, queue: str, via: int) -> int:
    info = queue_info(made, queue, via)
    assert info is not None, f"node {via} does not list {queue}"
    return int(info.leader_node_id)


def wait_in_sync(made: Cluster, queue: str, via: int, members: set[int], within: float) -> None:
    """Until node `via` lists `members` as `queue`'s in-sync set."""

    def synced() -> bool:
        info = queue_info(made, queue, via)
        return info is not None and set(info.in_sync_node_ids) == members

    wait_until(synced, within, what=f"{queue} in sync on {sorted(members)}")


def stored(data_dir: Path, queue: str) -> tuple[dict[bytes, bytes], Position | None]:
    """What a stopped node's disk holds of `queue` (and its DLQ): its records (the
    queue records, the messages naming them, and those messages' lease and delay
    records, read here on their own, not through the code under test), and its
    replica's position."""
    names = {queue, f"{queue}.dlq"}
    storage = RocksStorage(data_dir)
    try:
        records = {
            key: value
            for name in names
            for key, value in storage.scan(keys.queue_key(name))
            if key == keys.queue_key(name)
        }
        for key, value in storage.scan(keys.MESSAGE):
            if messages_pb2.Message.FromString(value).metadata.queue_id in names:
                records[key] = value
        for prefix in (keys.LEASE, keys.DELAY):
            for key, value in storage.scan(prefix):
                if keys.message_key_from_side_key(key) in records:
                    records[key] = value
        raw = storage.get(keys.replica_key(queue))
        return records, None if raw is None else Position.decode(raw)
    finally:
        storage.close()
