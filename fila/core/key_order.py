"""Message keys in order, for paging a map of them by id (PeekMessages' `after_id`).

Peek shows a queue's delayed and leased messages in id order, a page at a time.
Sorting the whole map for each page held the event loop in proportion to its size, so
a large map keeps its keys in a `SortedList` beside it: a page is then a bisect and a
walk of the page's length, whatever the size.

A sorted list costs an insert and a removal per key, which a lease (granted and ended
once per delivery) should not pay for an admin call most brokers never get. So the
order is kept only while the map is large: it is built (one sort of `SORTED_FROM`
keys) when the map grows to that size, and dropped when it shrinks below
`UNSORTED_BELOW`; until then a page sorts the map, which is never larger than that.
The costs either way are in docs/benchmarks.md. The owner of the map calls `added`,
`removed` and `cleared` as it changes the map, and nothing else changes it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

from sortedcontainers import SortedList

SORTED_FROM = 4096
UNSORTED_BELOW = 1024


class KeyOrder:
    """The keys of one map (`keys`, the map itself or its key view), in order."""

    __slots__ = ("_keys", "_sorted")

    def __init__(self, keys: Collection[bytes]) -> None:
        self._keys = keys
        self._sorted: SortedList[bytes] | None = None

    def added(self, key: bytes) -> None:
        """`key` is new in the map."""
        ordered = self._sorted
        if ordered is not None:
            ordered.add(key)
        elif len(self._keys) >= SORTED_FROM:
            self._sorted = SortedList(self._keys)

    def removed(self, key: bytes) -> None:
        """`key` left the map."""
        ordered = self._sorted
        if ordered is not None:
            ordered.discard(key)
            if len(ordered) < UNSORTED_BELOW:
                self._sorted = None

    def cleared(self) -> None:
        self._sorted = None

    @property
    def kept(self) -> bool:
        """Whether the order is kept now (the map is large), rather than sorted per call."""
        return self._sorted is not None

    def after(self, after: bytes) -> Iterator[bytes]:
        """The map's keys above `after`, in order (do not change the map meanwhile)."""
        ordered = self._sorted
        if ordered is None:
            return iter(sorted(key for key in self._keys if key > after))
        return ordered.irange(after, inclusive=(False, True))
