"""Moves the records of an older key layout to the current one, at startup.

Queue records and the cluster identity used to sort after the messages (tags
``q`` and ``n``); they now sort before them (see `fila.storage.keys`, which says
why). A data directory written before that change is upgraded the first time a
broker opens it: every such record is rewritten under its new tag and the old key
deleted, in one atomic batch, synced before anything reads the data. A crash
during the upgrade leaves either the old layout or the new one, never a mix, and
the next start finishes the job.

A record present under both tags means two brokers of different versions wrote the
directory (an older one opened it after an upgrade); which copy is current cannot
be told, so the broker refuses to start and names the record instead of guessing.
"""

from __future__ import annotations

from fila.storage import keys
from fila.storage.backend import Batch, CorruptionError, Storage


def upgrade_layout(storage: Storage) -> int:
    """Moves every record under a legacy tag to its current tag; how many were moved."""
    batch = Batch()
    moved = 0
    for legacy, current in keys.LEGACY_TAGS.items():
        for old_key, value in storage.scan(legacy):
            new_key = current + old_key[len(legacy) :]
            if storage.get(new_key) is not None:
                raise CorruptionError(
                    f"record {old_key[:64]!r} is stored under both its old and its new key "
                    f"({new_key[:64]!r}): this data directory was written by fila-server "
                    "versions of two key layouts, and which copy is current is unknown"
                )
            batch.put(new_key, value)
            batch.delete(old_key)
            moved += 1
    if moved:
        storage.write(batch)
        storage.sync()
    return moved
