"""The one place that knows how broker state is laid out in RocksDB.

Every key starts with a one-byte tag naming the record kind; the rest of the key
is a single component, so no length prefixes are needed and no two kinds can
collide. Message ids are UUIDv7 stored as their 16 raw bytes, which are
big-endian millisecond timestamps first: a prefix scan over ``m`` returns
messages in enqueue order, which is how recovery rebuilds FIFO order per
fairness key.

    Q<queue name utf-8>   -> QueueRecord JSON (see fila.core.queue)
    m<message id 16 B>    -> fila.v1.Message protobuf; the authoritative copy of
                             headers, payload and metadata, including the
                             queue it currently belongs to and attempt_count
    l<message id 16 B>    -> lease: u64 BE deadline ms, u64 BE leased-at ms
    d<message id 16 B>    -> delayed retry: u64 BE due ms
    c<config key utf-8>   -> runtime config value utf-8
    k<api key id utf-8>   -> API key record JSON: name, SHA-256 digest, times, superadmin
                             (see fila.security.apikeys; never the key itself)
    a<api key id utf-8>   -> ACL JSON: [[kind, pattern], ...]; absent = no permissions
    N<name utf-8>         -> cluster identity of this data directory (cluster mode only,
                             see fila.cluster.identity): `node_id` and `lease`, decimal
    X<original key>       -> a record that did not decode, set aside as it was stored
                             (see fila.core.quarantine); nothing reads it but an operator
    R<queue name utf-8>   -> this node's replica of a replicated queue (cluster mode
                             only): its position JSON, written with each batch of the
                             queue (see fila.cluster.replication.position)

Messages are keyed by id alone, not by queue, so dead-lettering and redrive
rewrite one value in place instead of moving it between keys.

Message keys sort after every other key, and new ids after older ones, so a burst of
enqueues writes tables whose key ranges overlap nothing already stored, and RocksDB
moves them down the levels without rewriting them (a "trivial move"). With queue
records under ``q`` (after ``m``), the table holding the newest stored messages also
held the queue records, so its key range covered every later message: a burst then
cost compactions rewriting about all it wrote, one of them after the burst, and an
enqueue's p99 rose above its p99 at rest while they ran. With this order no
compaction rewrote anything and the p99 stayed close to rest (figures:
docs/benchmarks.md, "Measurements behind design choices"). Acks and leases still
overlap older tables, so a burst with consumers acking meanwhile is still compacted.
Hence upper-case ``Q`` and ``N``; a new record kind must also take a tag below ``m``
(tests/test_storage_layout.py checks). Data directories written with the older tags
are moved over at startup (`fila.storage.layout`); `LEGACY_TAGS` are never to be
reused.
"""

from __future__ import annotations

import struct
import uuid
from typing import Final

QUEUE: Final = b"Q"
MESSAGE: Final = b"m"
LEASE: Final = b"l"
DELAY: Final = b"d"
CONFIG: Final = b"c"
API_KEY: Final = b"k"
ACL: Final = b"a"
NODE: Final = b"N"
QUARANTINE: Final = b"X"
REPLICA: Final = b"R"

# The tags of an older layout, each with the tag its records now live under.
LEGACY_TAGS: Final = {b"q": QUEUE, b"n": NODE}

_TWO_U64: Final = struct.Struct(">QQ")
_ONE_U64: Final = struct.Struct(">Q")


def queue_key(name: str) -> bytes:
    return QUEUE + name.encode()


def replica_key(queue: str) -> bytes:
    return REPLICA + queue.encode()


def replica_name_from_key(key: bytes) -> str:
    return key[1:].decode()


def queue_name_from_key(key: bytes) -> str:
    return key[1:].decode()


def message_key(message_id: str) -> bytes:
    return MESSAGE + uuid.UUID(message_id).bytes


def lease_key(message_key_: bytes) -> bytes:
    return LEASE + message_key_[1:]


def delay_key(message_key_: bytes) -> bytes:
    return DELAY + message_key_[1:]


def message_key_from_side_key(side_key: bytes) -> bytes:
    """Maps a lease or delay key back to the message key it belongs to."""
    return MESSAGE + side_key[1:]


def config_key(key: str) -> bytes:
    return CONFIG + key.encode()


def config_name_from_key(key: bytes) -> str:
    return key[1:].decode()


def api_key_key(key_id: str) -> bytes:
    return API_KEY + key_id.encode()


def acl_key(key_id: str) -> bytes:
    return ACL + key_id.encode()


def key_id_from_key(key: bytes) -> str:
    """The API key id of an `api_key_key` or `acl_key`."""
    return key[1:].decode()


def node_key(name: str) -> bytes:
    return NODE + name.encode()


def quarantine_key(original: bytes) -> bytes:
    return QUARANTINE + original


def original_from_quarantine_key(key: bytes) -> bytes:
    return key[1:]


def encode_lease(deadline_ms: int, leased_at_ms: int) -> bytes:
    return _TWO_U64.pack(deadline_ms, leased_at_ms)


def decode_lease(value: bytes) -> tuple[int, int]:
    """Raises ValueError for a value that is not a lease."""
    if len(value) != _TWO_U64.size:
        raise ValueError(f"a lease record is {_TWO_U64.size} bytes, this one {len(value)}")
    deadline_ms, leased_at_ms = _TWO_U64.unpack(value)
    return int(deadline_ms), int(leased_at_ms)


def encode_due(due_ms: int) -> bytes:
    return _ONE_U64.pack(due_ms)


def decode_due(value: bytes) -> int:
    """Raises ValueError for a value that is not a due time."""
    if len(value) != _ONE_U64.size:
        raise ValueError(f"a delay record is {_ONE_U64.size} bytes, this one {len(value)}")
    return int(_ONE_U64.unpack(value)[0])


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix`."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        raise ValueError("prefix has no upper bound")
    return stripped[:-1] + bytes([stripped[-1] + 1])
