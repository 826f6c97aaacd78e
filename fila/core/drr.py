"""Deficit Round Robin over one queue's fairness keys.

Keys with ready messages sit in a ring. When a key's turn comes it gains
``quantum * weight`` deficit; each delivery costs 1; the turn ends when the
deficit is spent, the key runs dry, or its next message is throttled. A key
that runs dry leaves the ring and forgets its deficit. A throttled key is
parked outside the ring until the owner returns it with `unpark` (when its
tokens can be there) or `unpark_all` (a throttle changed), so a backlog of
throttled keys costs nothing per pick.

The ring is a circular doubly linked list threaded through the keys themselves
(`FairnessKey.next` / `prev`), its head the key whose turn it is: moving the turn
on, adding a key at the tail and taking any key out (a redrive or purge empties
keys anywhere in the ring) are each O(1), whatever the number of keys.

The turn state lives across `pick` calls because deliveries are pulled one at
a time, as consumers have room. With the default quantum of 1, a key of weight
w gets exactly w deliveries per round, which keeps every key within a few
messages of its weighted share over any window (the fairness requirement is
1 percentage point over 5,000 deliveries).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from fila.core.fairness_key import FairnessKey, ThrottleTable
from fila.core.records import MessageRef

TokenCheck = Callable[[tuple[str, ...]], bool]

__all__ = ["Drr", "FairnessKey", "TokenCheck"]


class Drr:
    def __init__(self, quantum: int) -> None:
        self.quantum = quantum
        self.keys: dict[str, FairnessKey] = {}
        self._throttles = ThrottleTable()
        self._head: FairnessKey | None = None  # the ring's first key: its turn, or next
        self._turn_open = False
        self._parked: dict[str, FairnessKey] = {}
        # Keys parked since the owner last looked; only these can need an earlier wake-up.
        self.newly_parked: list[FairnessKey] = []
        self.ready_count = 0

    def push(self, ref: MessageRef, *, fresh: bool) -> None:
        """Adds a ready message in id order within its key.

        Ids are UUIDv7, so id order is enqueue order: a retried, redriven or
        dead-lettered message takes its original place (ahead of newer ones),
        and recovery, which scans messages in id order, rebuilds the very same
        order. `fresh` means `on_enqueue` just decided the message's weight, which
        then becomes its key's weight.
        """
        key = self.keys.get(ref.fairness_key)
        if key is None:
            key = FairnessKey(ref.fairness_key, ref.weight, self._throttles)
            self.keys[ref.fairness_key] = key
            self._link(key)
        elif fresh:
            key.weight = ref.weight
        key.push(ref)
        self.ready_count += 1

    def pick(self, has_tokens: TokenCheck | None) -> MessageRef | None:
        """The next message by DRR, or None if every ready key is empty or parked."""
        while (key := self._head) is not None:
            if not self._turn_open:
                # Only a parked key ends a turn with deficit left; capping keeps a
                # key that is parked again and again from saving up a burst.
                share = self.quantum * key.weight
                key.deficit = min(key.deficit + share, share)
                self._turn_open = True
            if key.deficit <= 0:
                self._head = key.next
                self._turn_open = False
                continue
            if has_tokens is not None:
                throttle_keys = key.head_throttle_keys()
                blocked = bool(throttle_keys) and not has_tokens(throttle_keys)
            else:
                blocked = False
            if blocked:
                self._unlink(key)
                key.parked = True
                self._parked[key.name] = key
                self.newly_parked.append(key)
                continue
            head = key.popleft()
            key.deficit -= 1
            self.ready_count -= 1
            if not key:
                self._unlink(key)
                del self.keys[key.name]
            return head
        return None

    def unpark_all(self) -> bool:
        """Returns every parked key to the ring; True if there were any."""
        if not self._parked:
            return False
        for key in self._parked.values():
            key.parked = False
            self._link(key)
        self._parked.clear()
        self.newly_parked.clear()
        return True

    def unpark(self, keys: list[FairnessKey]) -> bool:
        """Returns these keys to the ring if they are still parked; True if any was."""
        parked = self._parked
        back = False
        for key in keys:
            # A key that emptied is gone, and one of its name may be parked now: only
            # the very key returns (popping by name would lose the other one).
            if parked.get(key.name) is key:
                del parked[key.name]
                key.parked = False
                self._link(key)
                back = True
        return back

    def take_newly_parked(self) -> list[FairnessKey]:
        """Keys parked since the last call that are still parked (and so non-empty)."""
        keys = [key for key in self.newly_parked if key.parked]
        self.newly_parked.clear()
        return keys

    def upcoming(self) -> Iterator[MessageRef]:
        """The ready messages in the order `take` takes them, lazily, changing nothing
        (do not change the DRR while iterating)."""
        first = key = self._head
        while key is not None:
            yield from key.iter_from()
            key = key.next
            if key is first:
                break
        for key in self._parked.values():
            yield from key.iter_from()

    def take(self, limit: int) -> list[MessageRef]:
        """Takes up to `limit` ready messages out (redrive): key by key, from the ring's
        head round, then the parked keys, oldest first within each key. The work is
        O(what is taken), however many keys there are."""
        taken: list[MessageRef] = []
        for key in self._take_order(limit):
            while key and len(taken) < limit:
                taken.append(key.popleft())
            if not key:
                self._drop_key(key)
        self.ready_count -= len(taken)
        return taken

    def detach(self) -> Iterable[FairnessKey]:
        """Takes every ready message out at once, as the keys holding them, in O(1)
        (purge and DeleteQueue of any size; `fila.core.removal`): the caller owns the
        keys from now on, and wake-ups that still name one find it gone (`unpark`)."""
        detached = self.keys.values()
        self.keys = {}
        self._head = None
        self._parked = {}
        self.newly_parked = []
        self._turn_open = False
        self.ready_count = 0
        return detached

    def iter_ready(self) -> Iterator[MessageRef]:
        """Every ready message, key by key in the order the keys came, oldest first."""
        for key in self.keys.values():
            yield from key.iter_from()

    # -- internals -------------------------------------------------------------------

    def _take_order(self, limit: int) -> list[FairnessKey]:
        """The keys `take(limit)` takes from, in order, holding `limit` messages or all."""
        keys: list[FairnessKey] = []
        count = 0
        first = key = self._head
        while key is not None and count < limit:
            keys.append(key)
            count += len(key)
            key = key.next
            if key is first:
                break
        if count < limit:
            for key in self._parked.values():
                keys.append(key)
                count += len(key)
                if count >= limit:
                    break
        return keys

    def _link(self, key: FairnessKey) -> None:
        """Adds `key` at the ring's tail (just before the head): its turn comes last."""
        head = self._head
        if head is None:
            key.next = key.prev = key
            self._head = key
            return
        tail = head.prev
        assert tail is not None, "a ring key is linked both ways"
        key.prev = tail
        key.next = head
        tail.next = key
        head.prev = key

    def _unlink(self, key: FairnessKey) -> None:
        """Takes `key` out of the ring; if its turn was running, the turn ends."""
        after, before = key.next, key.prev
        assert after is not None and before is not None, "only a ring key is unlinked"
        key.next = key.prev = None
        if after is key:
            self._head = None
            self._turn_open = False
            return
        before.next = after
        after.prev = before
        if self._head is key:
            self._head = after
            self._turn_open = False

    def _drop_key(self, key: FairnessKey) -> None:
        del self.keys[key.name]
        if key.parked:
            del self._parked[key.name]
            key.parked = False  # wake-ups that still name it find it gone
        else:
            self._unlink(key)
