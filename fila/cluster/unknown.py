"""Queue names etcd was just asked about and does not know, remembered briefly.

`Router.target` asks etcd (a linearizable read) about a queue this node's copy does
not know, so that a queue created through another node is found at once. A caller
naming the same unknown queue again and again would make one read each; remembered
for `UNKNOWN_TTL_MS`, such a name costs one read per that time. A queue this node
then learns of (its watch, or a create through this node) is found in its copy
before this is asked, and a create through this node also `forget`s the name, so the
window in which "no such queue" can be stale is that of a queue created through
another node within `UNKNOWN_TTL_MS` of a lookup here, until this node's watch
brings it (a few milliseconds).

At most `MAX_UNKNOWN` names are kept: the oldest give way (all entries live equally
long, so the oldest is the first to expire).
"""

from __future__ import annotations

from typing import Final

from fila.clock import Clock

UNKNOWN_TTL_MS: Final = 1000
MAX_UNKNOWN: Final = 10_000


class UnknownQueues:
    """Owned by the Router; driven from the event loop only."""

    __slots__ = ("_clock", "_max", "_ttl_ms", "_until")

    def __init__(
        self, clock: Clock, ttl_ms: int = UNKNOWN_TTL_MS, max_entries: int = MAX_UNKNOWN
    ) -> None:
        self._clock = clock
        self._ttl_ms = ttl_ms
        self._max = max_entries
        self._until: dict[str, int] = {}  # name -> expiry; insertion order is expiry order

    def __len__(self) -> int:
        return len(self._until)

    def known_unknown(self, name: str) -> bool:
        """Whether etcd said it has no queue `name` within the last `UNKNOWN_TTL_MS`."""
        until = self._until.get(name)
        if until is None:
            return False
        if until > self._clock.now_ms():
            return True
        del self._until[name]
        return False

    def note(self, name: str) -> None:
        """etcd has no queue `name` now."""
        until = self._until
        until.pop(name, None)
        now = self._clock.now_ms()
        while until and (len(until) >= self._max or next(iter(until.values())) <= now):
            del until[next(iter(until))]
        until[name] = now + self._ttl_ms

    def forget(self, name: str) -> None:
        """A queue `name` was just created through this node."""
        self._until.pop(name, None)
