"""This node's replicas on disk (`ports.Store`): a replica's operations go through the
group committer with its position (`R<queue>`, `fila.storage.keys`) in the same
batch, and the protocol hears `applied` once that batch is fsynced.

Why the committer: a follower's batches share the group commit (one fsync) with the
node's own writes. They are written untagged (`Committer.replicate`), so they belong
to no queue this node leads, and the follower acknowledges on the batch's fsync
(`Committer.when_durable`), not once the node's own writes in the same batch are
replicated: two nodes following each other would otherwise wait on each other.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from fila.cluster.replication.messages import Ops
from fila.cluster.replication.position import Position
from fila.cluster.replication.records import queue_records
from fila.storage import keys
from fila.storage.backend import Storage
from fila.storage.committer import Committer

log = logging.getLogger("fila.cluster.replication")


def replicas_on_disk(storage: Storage) -> set[str]:
    """The replicated queues this node holds a replica of (leading or following):
    startup leaves them to the replication protocol (`Broker.recover(held=...)`)."""
    return {keys.replica_name_from_key(key) for key, _ in storage.scan(keys.REPLICA)}


class ReplicaStore:
    def __init__(
        self, storage: Storage, committer: Committer, applied: Callable[[str, int], None]
    ) -> None:
        self._storage = storage
        self._committer = committer
        self._applied = applied

    def positions(self) -> dict[str, Position]:
        found: dict[str, Position] = {}
        for key, value in self._storage.scan(keys.REPLICA):
            group = keys.replica_name_from_key(key)
            try:
                found[group] = Position.decode(value)
            except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
                # Read as no replica: it catches up before it may lead or count in sync.
                log.error("unreadable replica position of queue %s ignored: %s", group, exc)
        return found

    def apply(self, group: str, ops: Ops, position: Position) -> None:
        self._committer.replicate((*ops, (keys.replica_key(group), position.encode())))
        self._when_durable(group, position.seq)

    def record(self, group: str, position: Position) -> None:
        self._committer.replicate(((keys.replica_key(group), position.encode()),))

    def begin_snapshot(self, group: str) -> None:
        self._delete_records(group)
        self.record(group, Position(0, (), complete=False))

    def add_snapshot(self, group: str, ops: Ops) -> None:
        self._committer.replicate(ops)

    def end_snapshot(self, group: str, position: Position) -> None:
        self.record(group, position)
        self._when_durable(group, position.seq)

    def drop(self, group: str) -> None:
        self._delete_records(group)
        self._committer.replicate(((keys.replica_key(group), None),))

    def _delete_records(self, group: str) -> None:
        """Deletes what this node stores of `group` (what it wrote this turn included:
        the open batch is written first, so the view sees it)."""
        self._committer.write_now()
        for chunk in queue_records(self._storage.view(), group):
            self._committer.replicate(tuple((key, None) for key, _ in chunk))

    def _when_durable(self, group: str, seq: int) -> None:
        applied = self._applied
        self._committer.when_durable(lambda: applied(group, seq))
