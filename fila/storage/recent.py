"""Message records written lately, kept in memory so a delivery need not read them back.

A message is delivered soon after it is written, as a rule: a consumer that keeps
up takes it within a round trip. Reading its record back from RocksDB at delivery
was a point read per message, a quarter of the broker's time when draining. So the
committer, which every write passes through, keeps each message record it writes
here until it is delivered (`take`), deleted, or written again, within a byte budget
(`RecentRecords.limit`): past it, new records are not kept and their deliveries read
from storage as before, so a backlog of millions costs no more memory than before.

Coherent by construction: every put of a message record replaces the entry, every
delete drops it, both on the loop, in write order; so `take` returns exactly what
storage holds for that key (or nothing). Only message records (`keys.MESSAGE`) are
kept: leases, delays and queue records are never read at delivery.
"""

from __future__ import annotations

from fila.storage import keys

_MESSAGE = keys.MESSAGE[0]
# Per entry beyond its bytes: the dict slot and the key and value objects' headers.
ENTRY_OVERHEAD_BYTES = 120


class RecentRecords:
    __slots__ = ("_records", "limit", "size")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0  # bytes held, with `ENTRY_OVERHEAD_BYTES` per entry
        self._records: dict[bytes, bytes] = {}

    def __len__(self) -> int:
        return len(self._records)

    def wrote(self, key: bytes, value: bytes) -> None:
        """`key` was written with `value`: kept if it is a message record and fits."""
        if key[0] != _MESSAGE:
            return
        records = self._records
        old = records.pop(key, None)
        if old is not None:
            self.size -= len(old) + ENTRY_OVERHEAD_BYTES
        cost = len(value) + ENTRY_OVERHEAD_BYTES
        if self.size + cost <= self.limit:
            records[key] = value
            self.size += cost

    def deleted(self, key: bytes) -> None:
        old = self._records.pop(key, None)
        if old is not None:
            self.size -= len(old) + ENTRY_OVERHEAD_BYTES

    def take(self, key: bytes) -> bytes | None:
        """The record last written under `key`, given up (a delivery takes it once);
        None if it was not kept."""
        value = self._records.pop(key, None)
        if value is not None:
            self.size -= len(value) + ENTRY_OVERHEAD_BYTES
        return value
