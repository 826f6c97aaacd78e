"""What a data directory remembers about the cluster node that owns it.

- `node_id`: the queues in this directory are placed on that node in etcd, so the
  directory must never be started under another id (its queues would be served by a
  node etcd does not name as their owner). Recorded at the first cluster start.
- `lease`: the etcd lease the node held last. After a `kill -9` the old lease lives
  on in etcd for up to `lease_ttl_ms`, holding the node's membership key. RocksDB's
  lock means only one process holds this directory, so a membership key held by the
  lease recorded here belongs to a dead predecessor of this very node, and can be
  revoked at once instead of waited out: a restarted owner serves again without
  waiting for its old lease to expire.

Both live in the broker's own RocksDB (`fila.storage.keys.node_key`), written through
the committer and synced before the node relies on them.
"""

from __future__ import annotations

from fila.cluster.errors import Misconfigured
from fila.storage import keys
from fila.storage.backend import Storage
from fila.storage.committer import Committer


class IdentityMismatch(Misconfigured):
    """The data directory belongs to another node id: the configuration names the
    wrong id or the wrong directory, which a restart cannot change."""


class Identity:
    def __init__(self, storage: Storage, committer: Committer) -> None:
        self._storage = storage
        self._committer = committer

    def claim_node_id(self, node_id: int) -> None:
        """Records `node_id` on first use; raises IdentityMismatch if another is recorded."""
        stored = self._read("node_id")
        if stored is not None and stored != node_id:
            raise IdentityMismatch(
                f"this data directory belongs to cluster node {stored}, not {node_id}: its "
                "queues are placed on that node in etcd. Start it with node_id "
                f"{stored}, or use another data directory"
            )
        if stored is None:
            self._committer.put(keys.node_key("node_id"), str(node_id).encode())
            self._committer.flush_now()  # at startup, before anything is served

    def last_lease(self) -> int | None:
        return self._read("lease")

    async def record_lease(self, lease: int) -> None:
        """Durable before the lease is used for the membership key."""
        self._committer.put(keys.node_key("lease"), str(lease).encode())
        await self._committer.flushed()

    def _read(self, name: str) -> int | None:
        raw = self._storage.get(keys.node_key(name))
        return None if raw is None else int(raw.decode())
