"""The broker as the replication protocol sees it (`ports.Host`): a queue this node
starts to lead is rebuilt from its stored records as a restart would (`Broker.
recover_queues`: messages ready, leases with their deadlines, delays with their due
times, DLQ entries); a queue it no longer leads is let go of in memory, its records
kept (`Broker.unload_queue`); a snapshot is the queue's records as they are now."""

from __future__ import annotations

from collections.abc import Iterator

from fila.cluster.errors import LeaderChanged
from fila.cluster.replication.messages import Ops
from fila.cluster.replication.records import queue_records
from fila.core.broker import Broker
from fila.storage import keys
from fila.storage.backend import Storage
from fila.wire import dlq_name


class BrokerHost:
    def __init__(self, broker: Broker, storage: Storage) -> None:
        self._broker = broker
        self._storage = storage

    def promote(self, group: str) -> None:
        names = (group, dlq_name(group))
        if all(self._storage.get(keys.queue_key(name)) is None for name in names):
            return  # nothing stored yet (a queue being created): nothing to load
        self._broker.recover_queues(names)

    def demote(self, group: str) -> None:
        self._broker.committer.write_now()  # what it wrote for the queue goes out first
        for name in (group, dlq_name(group)):
            self._broker.unload_queue(name, LeaderChanged(group))

    def snapshot(self, group: str) -> Iterator[Ops]:
        return queue_records(self._storage.view(), group)
