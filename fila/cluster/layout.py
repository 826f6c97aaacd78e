"""The one place that knows how cluster state is laid out in etcd, and how its values
are encoded. Every other module asks it for keys and values.

Under `[cluster] etcd_prefix` (default `/fila`):

    <prefix>/nodes/<node id>        -> NodeRecord JSON; attached to the node's lease,
                                       so it exists exactly while the node is alive
    <prefix>/queues/<queue name>    -> Placement JSON: the owner of the queue and its
                                       DLQ (the DLQ has no key of its own); for a
                                       replicated queue also its replicas, in-sync
                                       set, epoch and leader's lease
    <prefix>/config/<config key>    -> runtime config value, UTF-8 (SPEC 2)
    <prefix>/apikeys/<key id>       -> ApiKeyRecord JSON (fila.security.apikeys: never
                                       the key itself, only its SHA-256 digest)
    <prefix>/acls/<key id>          -> ACL JSON [[kind, pattern], ...] (absent: none)
    <prefix>/digests/<sha256 hex>   -> key id: finds a presented key's record with one
                                       read when a node has not seen it yet

Node ids are written in decimal and queue names as they are (SPEC 2 limits them to
`A-Z a-z 0-9 . _ - :`), so a key never needs escaping and a prefix scan of
`<prefix>/queues/` lists every queue.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Final

from fila.wire import dlq_owner

NODES: Final = "nodes/"
QUEUES: Final = "queues/"
CONFIG: Final = "config/"
API_KEYS: Final = "apikeys/"
ACLS: Final = "acls/"
DIGESTS: Final = "digests/"


class Layout:
    def __init__(self, prefix: str) -> None:
        self.root = prefix.rstrip("/") + "/"

    def section(self, name: str) -> str:
        """The prefix of one section (`NODES`, `QUEUES`, ...)."""
        return self.root + name

    def node(self, node_id: int) -> str:
        return self.root + NODES + str(node_id)

    def queue(self, name: str) -> str:
        return self.root + QUEUES + name

    def config(self, key: str) -> str:
        return self.root + CONFIG + key

    def api_key(self, key_id: str) -> str:
        return self.root + API_KEYS + key_id

    def acl(self, key_id: str) -> str:
        return self.root + ACLS + key_id

    def digest(self, digest: bytes) -> str:
        return self.root + DIGESTS + digest.hex()


def placed_name(queue: str) -> str:
    """The queue whose placement covers `queue`: a DLQ lives with its queue."""
    return dlq_owner(queue) or queue


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A live node's membership record. `lease` is the etcd lease it is attached to,
    which tells one incarnation of a node from the next (a replicated queue's record
    names the lease its leader held)."""

    node_id: int
    advertise_addr: str
    started_at_ms: int
    lease: int = 0

    def encode(self) -> bytes:
        return json.dumps(
            {
                "node_id": self.node_id,
                "advertise_addr": self.advertise_addr,
                "started_at_ms": self.started_at_ms,
                "lease": self.lease,
            }
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> NodeRecord:
        doc = json.loads(raw)
        return cls(
            int(doc["node_id"]),
            str(doc["advertise_addr"]),
            int(doc["started_at_ms"]),
            int(doc.get("lease", 0)),
        )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a queue lives. `node_id` is its owner: the leader of a replicated queue.
    `claim` is unique per CreateQueue call, so a node whose create transaction's
    answer was lost can tell its own claim from a rival's.

    A replicated queue (`replicas` not empty: `[cluster] replication_factor` > 1 when
    it was created) also records its replica set (leader included), its in-sync set
    (`isr`, leader included), the leader's `epoch` and the etcd lease the leader held
    when it took the lead (`leader_lease`): a leader that restarted, or lost its lease,
    is another incarnation and leads no more (`fila.cluster.replication`). Such a record
    changes only by a transaction that compares it with the value it replaces, whose
    bytes `raw` keeps as etcd holds them."""

    node_id: int
    claim: str
    created_at_ms: int
    replicas: tuple[int, ...] = ()
    isr: tuple[int, ...] = ()
    epoch: int = 0
    leader_lease: int = 0
    version: int = 0  # one more with every change: a compare on the value is ABA-free
    raw: bytes = field(default=b"", compare=False, repr=False)

    @property
    def replicated(self) -> bool:
        return bool(self.replicas)

    def encode(self) -> bytes:
        doc: dict[str, object] = {
            "node_id": self.node_id,
            "claim": self.claim,
            "created_at_ms": self.created_at_ms,
        }
        if self.replicas:
            doc.update(
                replicas=list(self.replicas),
                isr=list(self.isr),
                epoch=self.epoch,
                leader_lease=self.leader_lease,
                version=self.version,
            )
        return json.dumps(doc).encode()

    def stored(self) -> bytes:
        """The bytes etcd holds for this record (for a compare)."""
        return self.raw or self.encode()

    @classmethod
    def decode(cls, raw: bytes) -> Placement:
        doc = json.loads(raw)
        return cls(
            int(doc["node_id"]),
            str(doc["claim"]),
            int(doc["created_at_ms"]),
            tuple(int(n) for n in doc.get("replicas", ())),
            tuple(int(n) for n in doc.get("isr", ())),
            int(doc.get("epoch", 0)),
            int(doc.get("leader_lease", 0)),
            int(doc.get("version", 0)),
            bytes(raw),
        )
