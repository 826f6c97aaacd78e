"""A fairness key: its DRR state and its ready messages, in id order, at ~20 bytes each.

A backlog is mostly ready messages, and a Python object per message (a
`MessageRef` and its key bytes) costs several times what the packed form does: with
a million ready messages it was most of the broker's memory (figures:
docs/benchmarks.md, "Measurements behind design choices"). So a key's ready
messages are packed instead: their 16-byte ids side by side in one `bytearray`,
and beside them, in an `array`, the index of their throttle-key tuple in a table
the queue's DRR shares. The rare message that carries more (a retry's attempt
count) keeps that in a small side map. A `MessageRef` is built only for the
message the DRR picks, and for the pages peek and redrive walk.

Ids are UUIDv7, so id order is enqueue order and almost every push appends. A
retried or redriven message goes back to its place by id (usually the front,
which costs nothing while the queue has room there, since taking from the front
only moves `head`); anywhere else is one `memmove`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from fila.core.records import MessageRef
from fila.storage import keys

_ID = 16
_MESSAGE = keys.MESSAGE


class ThrottleTable:
    """Throttle-key tuples by small index, shared by a queue's keys; 0 is ()."""

    __slots__ = ("_index", "tuples")

    def __init__(self) -> None:
        self.tuples: list[tuple[str, ...]] = [()]
        self._index: dict[tuple[str, ...], int] = {(): 0}

    def index(self, throttle_keys: tuple[str, ...]) -> int:
        found = self._index.get(throttle_keys)
        if found is None:
            found = self._index[throttle_keys] = len(self.tuples)
            self.tuples.append(throttle_keys)
        return found


class FairnessKey:
    """One key of a queue's DRR: its weight, deficit, whether it is parked and its
    neighbours in the ring (see `Drr`), and its ready messages, packed (see the module
    docstring)."""

    __slots__ = (
        "_attempts",
        "_head",
        "_ids",
        "_throttle",
        "_throttles",
        "deficit",
        "name",
        "next",
        "parked",
        "prev",
        "weight",
    )

    def __init__(self, name: str, weight: int, throttles: ThrottleTable) -> None:
        self.name = name
        self.weight = weight
        self.deficit = 0
        self.parked = False
        # The ring's links, owned by `Drr`: None while the key is not in the ring.
        self.next: FairnessKey | None = None
        self.prev: FairnessKey | None = None
        self._throttles = throttles
        self._ids = bytearray()
        self._throttle = array("I")
        self._head = 0  # records before it were taken; compacted when half the buffer
        self._attempts: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._throttle) - self._head

    def push(self, ref: MessageRef) -> None:
        """Adds a message at its place in id order."""
        raw = ref.key[1:]
        index = self._throttles.index(ref.throttle_keys)
        if ref.attempt_count:
            self._attempts[raw] = ref.attempt_count
        count = len(self._throttle)
        head = self._head
        if count == head or raw > self._ids[(count - 1) * _ID :]:
            self._ids += raw
            self._throttle.append(index)
            return
        if raw < self._raw(head) and head > 0:
            head -= 1
            self._ids[head * _ID : (head + 1) * _ID] = raw
            self._throttle[head] = index
            self._head = head
            return
        at = self._bisect(raw)
        self._ids[at * _ID : at * _ID] = raw
        self._throttle.insert(at, index)

    def popleft(self) -> MessageRef:
        ref = self._ref(self._head, take=True)
        self._head += 1
        if self._head == len(self._throttle):
            self._reset()
        elif self._head > 1024 and self._head * 2 > len(self._throttle):
            self._compact()
        return ref

    def head_throttle_keys(self) -> tuple[str, ...]:
        return self._throttles.tuples[self._throttle[self._head]]

    def peek_head(self) -> MessageRef:
        """The first message, as a ref, without taking it."""
        return self._ref(self._head)

    def first_key(self) -> bytes:
        return _MESSAGE + self._raw(self._head)

    def first_above(self, after: bytes) -> bytes | None:
        """The storage key of the first message above `after` (b"": the first), or None
        if there is none; O(1) unless `after` falls among the messages."""
        count, head = len(self._throttle), self._head
        if count == head:
            return None
        raw = after[1:]
        ids = self._ids
        if not after or ids[head * _ID : (head + 1) * _ID] > raw:
            return _MESSAGE + self._raw(head)
        if ids[(count - 1) * _ID :] <= raw:
            return None
        return _MESSAGE + self._raw(self._bisect(raw, right=True))

    def iter_from(self, after: bytes = b"") -> Iterator[MessageRef]:
        """Refs of the messages with a storage key above `after`, in order (a snapshot
        of positions: do not change the queue while iterating)."""
        start = self._bisect(after[1:], right=True) if after else self._head
        for position in range(start, len(self._throttle)):
            yield self._ref(position)

    def take_all(self) -> list[MessageRef]:
        refs = [self._ref(position) for position in range(self._head, len(self._throttle))]
        self._reset()
        return refs

    # -- internals -------------------------------------------------------------------

    def _raw(self, position: int) -> bytes:
        return bytes(self._ids[position * _ID : (position + 1) * _ID])

    def _ref(self, position: int, *, take: bool = False) -> MessageRef:
        raw = self._raw(position)
        attempts = self._attempts
        attempt = (attempts.pop(raw, 0) if take else attempts.get(raw, 0)) if attempts else 0
        return MessageRef(
            _MESSAGE + raw,
            self.name,
            self.weight,
            self._throttles.tuples[self._throttle[position]],
            attempt,
        )

    def _bisect(self, raw: bytes, *, right: bool = False) -> int:
        lo, hi = self._head, len(self._throttle)
        ids = self._ids
        while lo < hi:
            mid = (lo + hi) // 2
            probe = ids[mid * _ID : (mid + 1) * _ID]
            if probe < raw or (right and probe == raw):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _compact(self) -> None:
        head = self._head
        del self._ids[: head * _ID]
        del self._throttle[:head]
        self._head = 0

    def _reset(self) -> None:
        self._ids = bytearray()
        self._throttle = array("I")
        self._head = 0
        self._attempts.clear()
