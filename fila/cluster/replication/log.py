"""A queue's recent write batches in memory, for followers that catch up.

Leaders append what they write; followers append what they apply, so that a
follower that takes over can feed the others from where they stand. The log holds
contiguous sequences and is trimmed from the oldest end to `cap_bytes`: a follower
that needs an older batch gets a snapshot instead. Kept in memory only (the batches
are in RocksDB already, as key states, not as a log): after a restart a node's log
starts empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fila.cluster.replication.messages import Ops


@dataclass(frozen=True, slots=True)
class Entry:
    seq: int
    epoch: int
    ops: Ops
    size: int
    at_ms: int  # when it was appended (how long a follower has held it back)


def ops_size(ops: Ops) -> int:
    return sum(len(key) + (len(value) if value is not None else 0) + 8 for key, value in ops)


class Log:
    __slots__ = ("_entries", "bytes", "cap_bytes")

    def __init__(self, cap_bytes: int) -> None:
        self._entries: deque[Entry] = deque()
        self.bytes = 0
        self.cap_bytes = cap_bytes

    def append(self, seq: int, epoch: int, ops: Ops, at_ms: int) -> None:
        entries = self._entries
        if entries and entries[-1].seq + 1 != seq:
            entries.clear()  # not contiguous (after a snapshot): start again here
            self.bytes = 0
        entry = Entry(seq, epoch, ops, ops_size(ops), at_ms)
        entries.append(entry)
        self.bytes += entry.size
        while self.bytes > self.cap_bytes and len(entries) > 1:
            self.bytes -= entries.popleft().size

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def reaches(self, seq: int, last: int) -> bool:
        """Whether every batch after `seq` up to `last` is here."""
        if seq >= last:
            return True
        entries = self._entries
        return bool(entries) and entries[0].seq <= seq + 1 and entries[-1].seq >= last

    def get(self, seq: int) -> Entry | None:
        entries = self._entries
        if not entries:
            return None
        index = seq - entries[0].seq
        if 0 <= index < len(entries):
            return entries[index]
        return None
