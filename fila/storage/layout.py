"""Moves the records of an older key layout to the current one, at startup.

Queue records and the cluster identity used to sort after the messages (tags
``q`` and ``n``); they now sort before them (see `fila.storage.keys`, which says
why). A data directory written before that change is upgraded the first time a
broker opens it: every such record is rewritten under its new tag and the old key
deleted, in one atomic batch, synced before anything reads the data. A crash
during the upgrade leaves either the old layout or the new one, never a mix, and
the next start finishes the job.

A record found under both tags was written under the old one by an older
fila-server run after the upgrade (the upgrade leaves no old key behind, and this
version never writes one), so the old key holds the newer record: it replaces the
other, and the log names it.
"""

from __future__ import annotations

import logging

from fila.storage import keys
from fila.storage.backend import Batch, Storage

log = logging.getLogger("fila.storage")


def upgrade_layout(storage: Storage) -> int:
    """Moves every record under a legacy tag to its current tag; how many were moved."""
    batch = Batch()
    moved = 0
    for legacy, current in keys.LEGACY_TAGS.items():
        for old_key, value in storage.scan(legacy):
            new_key = current + old_key[len(legacy) :]
            if storage.get(new_key) is not None:
                log.warning(
                    "key layout: replaced a record with the one an older fila-server wrote later",
                    extra={"key": new_key.decode(errors="replace")},
                )
            batch.put(new_key, value)
            batch.delete(old_key)
            moved += 1
    if moved:
        storage.write(batch)
        storage.sync()
    return moved
