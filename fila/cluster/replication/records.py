"""Which stored records make up a replicated queue: its record and its DLQ's, their
messages (by the queue each message names, `metadata.queue_id`: message keys do not
contain it), and those messages' lease and delay records (`fila.storage.keys`).

A snapshot sends them; a follower about to install one, or dropping its replica,
deletes them. Finding a queue's messages reads every message record on the node (a
message's key does not name its queue), so this is for catch-up, not for a hot path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Final

from google.protobuf.message import DecodeError

from fila.cluster.replication.messages import Ops
from fila.storage import keys
from fila.storage.backend import StorageView
from fila.v1 import messages_pb2
from fila.wire import dlq_name

log = logging.getLogger("fila.cluster.replication")

CHUNK_BYTES: Final = 256 * 1024


def queue_records(view: StorageView, group: str) -> Iterator[Ops]:
    """Every record of `group` (the queue and its DLQ) in `view`, in chunks of about
    `CHUNK_BYTES`. A message record that does not decode is left out (its own node's
    recovery sets such records aside)."""
    names = (group, dlq_name(group))
    chunk: list[tuple[bytes, bytes | None]] = []
    size = 0
    for name in names:
        wanted = keys.queue_key(name)
        for key, value in view.scan(wanted):
            if key == wanted:
                chunk.append((key, value))
                size += len(key) + len(value)
    members: set[bytes] = set()
    for key, value in view.scan(keys.MESSAGE):
        try:
            queue = messages_pb2.Message.FromString(value).metadata.queue_id
        except DecodeError:
            continue
        if queue not in names:
            continue
        members.add(key)
        chunk.append((key, value))
        size += len(key) + len(value)
        if size >= CHUNK_BYTES:
            yield tuple(chunk)
            chunk, size = [], 0
    for prefix in (keys.LEASE, keys.DELAY):
        for key, value in view.scan(prefix):
            if keys.message_key_from_side_key(key) in members:
                chunk.append((key, value))
                size += len(key) + len(value)
                if size >= CHUNK_BYTES:
                    yield tuple(chunk)
                    chunk, size = [], 0
    if chunk:
        yield tuple(chunk)
