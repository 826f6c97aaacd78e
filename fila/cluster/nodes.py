"""Which nodes are alive: the mirrored `<prefix>/nodes/` section.

A node's record is attached to its etcd lease (`fila.cluster.lease`), so it exists
exactly while etcd considers the node alive: it appears when the node joins and
disappears when the node leaves, or `lease_ttl_ms` after it stopped renewing (a
crash, a cut network). "Up" everywhere in cluster mode means "has a record here".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from fila.cluster.layout import NodeRecord

log = logging.getLogger("fila.cluster")

Listener = Callable[[int, NodeRecord | None], None]


class Nodes:
    """The live nodes; a mirror `Section`. Listeners hear of every change (None: gone)."""

    def __init__(self) -> None:
        self._live: dict[int, NodeRecord] = {}
        self._seen: dict[int, str] = {}  # node id -> the address it last had, while up
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def get(self, node_id: int) -> NodeRecord | None:
        return self._live.get(node_id)

    def last_addr(self, node_id: int) -> str:
        """The address `node_id` had when this node last saw it up ("" if never)."""
        return self._seen.get(node_id, "")

    def live(self) -> list[NodeRecord]:
        return [self._live[node_id] for node_id in sorted(self._live)]

    def __len__(self) -> int:
        return len(self._live)

    # Section

    def put(self, name: str, value: bytes) -> None:
        try:
            record = NodeRecord.decode(value)
            node_id = int(name)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            log.error("unreadable node record in etcd ignored node=%s error=%s", name, exc)
            return
        if self._live.get(node_id) == record:
            return
        if node_id not in self._live:
            log.info("node up node=%d addr=%s", node_id, record.advertise_addr)
        self._live[node_id] = record
        self._seen[node_id] = record.advertise_addr
        for listener in self._listeners:
            listener(node_id, record)

    def delete(self, name: str) -> None:
        try:
            node_id = int(name)
        except ValueError:
            return
        if self._live.pop(node_id, None) is None:
            return
        log.info("node down node=%d", node_id)
        for listener in self._listeners:
            listener(node_id, None)
