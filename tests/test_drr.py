"""The DRR ring in-process: random pushes, picks, takes, parks and unparks against a
reference model, and removal that costs the same however many keys there are.

The model is DRR as SPEC 2 states it, written as plainly as possible (a list for the
ring, sorted lists for each key's messages); `Drr` must make exactly its choices.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from fila.core.drr import Drr, FairnessKey
from fila.core.records import MessageRef
from fila.storage import keys

THROTTLES: list[tuple[str, ...]] = [(), ("a",), ("a", "b")]


def _ref(n: int, key: str, weight: int = 1, throttle: tuple[str, ...] = ()) -> MessageRef:
    return MessageRef(keys.MESSAGE + n.to_bytes(16, "big"), key, weight, throttle, 0)


@dataclass
class ModelKey:
    weight: int
    deficit: int = 0
    parked: bool = False
    messages: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)


class ModelDrr:
    """SPEC 2's DRR, plainly: the ring a list whose first key has the turn."""

    def __init__(self, quantum: int) -> None:
        self.quantum = quantum
        self.keys: dict[str, ModelKey] = {}
        self.ring: list[str] = []
        self.parked: dict[str, ModelKey] = {}
        self.turn_open = False

    def push(self, n: int, name: str, weight: int, throttle: tuple[str, ...], fresh: bool) -> None:
        key = self.keys.get(name)
        if key is None:
            key = self.keys[name] = ModelKey(weight)
            self.ring.append(name)
        elif fresh:
            key.weight = weight
        key.messages.append((n, throttle))
        key.messages.sort()

    def pick(self, tokens: dict[str, int]) -> int | None:
        while self.ring:
            name = self.ring[0]
            key = self.keys[name]
            if not self.turn_open:
                share = self.quantum * key.weight
                key.deficit = min(key.deficit + share, share)
                self.turn_open = True
            if key.deficit <= 0:
                self.ring.append(self.ring.pop(0))
                self.turn_open = False
                continue
            throttle = key.messages[0][1]
            if throttle and not _try_take(tokens, throttle):
                self.ring.pop(0)
                self.turn_open = False
                key.parked = True
                self.parked[name] = key
                continue
            n, _ = key.messages.pop(0)
            key.deficit -= 1
            if not key.messages:
                self.ring.pop(0)
                self.turn_open = False
                del self.keys[name]
            return n
        return None

    def take(self, limit: int) -> list[int]:
        """From the ring's first key round, then the parked keys, oldest first in each."""
        taken: list[int] = []
        for name in [*self.ring, *self.parked]:
            key = self.keys[name]
            while key.messages and len(taken) < limit:
                taken.append(key.messages.pop(0)[0])
            if not key.messages:
                del self.keys[name]
                if key.parked:
                    del self.parked[name]
                else:
                    if self.ring[0] == name:
                        self.turn_open = False
                    self.ring.remove(name)
            if len(taken) >= limit:
                break
        return taken

    def unpark_all(self) -> None:
        for name, key in self.parked.items():
            key.parked = False
            self.ring.append(name)
        self.parked.clear()

    def unpark(self, names: list[str]) -> None:
        for name in names:
            key = self.parked.pop(name, None)
            if key is not None:
                key.parked = False
                self.ring.append(name)


def _try_take(tokens: dict[str, int], throttle: tuple[str, ...]) -> bool:
    if any(tokens[t] <= 0 for t in throttle):
        return False
    for t in throttle:
        tokens[t] -= 1
    return True


def _ring(drr: Drr) -> list[FairnessKey]:
    """The ring from its head, checking that every link is mirrored."""
    ring: list[FairnessKey] = []
    first = key = drr._head
    while key is not None:
        ring.append(key)
        assert key.next is not None and key.next.prev is key, "a broken link"
        key = key.next
        if key is first:
            break
        assert len(ring) <= len(drr.keys), "the ring does not close"
    return ring


def _check(drr: Drr, model: ModelDrr) -> None:
    ring = _ring(drr)
    assert [k.name for k in ring] == model.ring
    assert drr._turn_open == model.turn_open
    parked = {name for name, key in drr.keys.items() if key.parked}
    assert parked == set(model.parked)
    assert all(drr.keys.get(name) is key for name, key in drr._parked.items())
    assert set(drr._parked) == parked
    # ring membership = the keys with ready messages that are not parked
    assert {k.name for k in ring} | parked == set(drr.keys)
    assert all(len(key) > 0 for key in drr.keys.values()), "an empty key kept"
    assert all(key.next is None for key in drr.keys.values() if key.parked)
    assert set(drr.keys) == set(model.keys)
    for name, key in drr.keys.items():
        mine = model.keys[name]
        assert (key.weight, key.deficit) == (mine.weight, mine.deficit), name
        assert [(int.from_bytes(r.key[1:], "big"), r.throttle_keys) for r in key.iter_from()] == (
            mine.messages
        )
    assert drr.ready_count == sum(len(k.messages) for k in model.keys.values())


# Operation kinds by how often they come: pushes and picks the most, drains rarely.
_KINDS = ["push"] * 6 + ["pick"] * 4 + ["take"] * 2 + ["tokens"] * 2 + ["unpark_new"] * 2
_KINDS += ["wake_old", "unpark_all", "drain"]


@st.composite
def _op(draw: st.DrawFn) -> tuple[object, ...]:
    kind = draw(st.sampled_from(_KINDS))
    if kind == "push":
        return (
            kind,
            draw(st.integers(0, 300)),  # the first message's number (its id)
            draw(st.integers(0, 5)),  # fairness key: 0 and 1 mostly throttled, no others
            draw(st.integers(1, 3)),  # weight
            draw(st.sampled_from([0, 1, 1, 2])),  # throttle keys (of keys 0 and 1)
            draw(st.booleans()),  # fresh
            draw(st.integers(1, 4)),  # how many messages (ids n, n + 1000, ...)
        )
    if kind == "pick":
        return (kind, draw(st.integers(1, 4)))
    if kind == "take":
        return (kind, draw(st.integers(1, 6)))
    if kind == "tokens":
        return (kind, draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    return (kind,)


_ops = st.lists(_op(), min_size=20, max_size=100)


@settings(max_examples=200, deadline=None)
@given(quantum=st.integers(1, 3), ops=_ops)
def test_drr_makes_the_reference_models_choices_under_any_mix_of_operations(
    quantum: int, ops: list[tuple[object, ...]]
) -> None:
    """Random pushes, picks (with throttles running out), takes (redrive), unparks and
    drains: every pick and take matches the model, and after each step the ring holds
    exactly the unparked keys with ready messages, in the model's order, each key's
    messages in id order, deficits and weights as the model's (a key that empties
    starts again from nothing)."""
    drr, model = Drr(quantum), ModelDrr(quantum)
    tokens = {"a": 0, "b": 0}
    model_tokens = dict(tokens)
    seen: set[int] = set()
    ever_parked: list[FairnessKey] = []  # what throttle wake-ups hold: keys, some gone
    for op in ops:
        if op[0] == "push":
            _, first, key, weight, throttle, fresh, count = op
            assert isinstance(first, int) and isinstance(key, int) and isinstance(weight, int)
            assert isinstance(throttle, int) and isinstance(fresh, bool)
            throttle_keys = THROTTLES[throttle] if key < 2 else ()
            for n in range(first, first + 1000 * int(str(count)), 1000):
                if n in seen:
                    continue  # an id is in one place at a time
                seen.add(n)
                drr.push(_ref(n, f"k{key}", weight, throttle_keys), fresh=fresh)
                model.push(n, f"k{key}", weight, throttle_keys, fresh)
        elif op[0] == "pick":
            for _ in range(int(str(op[1]))):
                ref = drr.pick(lambda t: _try_take(tokens, t))
                got = None if ref is None else int.from_bytes(ref.key[1:], "big")
                assert got == model.pick(model_tokens)
            ever_parked += drr.newly_parked
        elif op[0] == "take":
            limit = int(str(op[1]))
            upcoming = [r.key for r in itertools.islice(drr.upcoming(), limit)]
            taken = [r.key for r in drr.take(limit)]
            assert taken == upcoming
            assert [int.from_bytes(k[1:], "big") for k in taken] == model.take(limit)
        elif op[0] == "tokens":
            tokens.update(a=int(str(op[1])), b=int(str(op[2])))
            model_tokens.update(tokens)
        elif op[0] == "unpark_all":
            drr.unpark_all()
            model.unpark_all()
        elif op[0] == "unpark_new":
            woken = drr.take_newly_parked()
            # only live parked keys: a stale one would be counted and woken for nothing
            assert all(drr.keys.get(k.name) is k and k.parked for k in woken)
            drr.unpark(woken)
            model.unpark([k.name for k in woken])
        elif op[0] == "wake_old":
            # every key ever parked, as the delivery's wake-up heap may hold them: only
            # the ones still parked come back, each once
            live = [k.name for k in ever_parked if drr._parked.get(k.name) is k]
            drr.unpark(ever_parked)
            model.unpark(list(dict.fromkeys(live)))
        elif op[0] == "drain":
            # purge and DeleteQueue: the keys leave whole; wake-ups naming them (the
            # "wake_old" step, after this) must find them gone
            drained = {
                int.from_bytes(key.popleft().key[1:], "big")
                for key in list(drr.detach())
                for _ in range(len(key))
            }
            assert drained == {n for k in model.keys.values() for n, _ in k.messages}
            model = ModelDrr(quantum)
        _check(drr, model)


def test_a_key_that_empties_leaves_the_ring_and_comes_back_with_no_deficit() -> None:
    drr = Drr(quantum=3)
    drr.push(_ref(1, "a"), fresh=True)
    drr.push(_ref(2, "a"), fresh=True)
    drr.push(_ref(3, "b"), fresh=True)
    assert drr.pick(None) is not None  # a's turn: deficit 3, then 2 left
    assert drr.keys["a"].deficit == 2
    assert [r.key for r in drr.take(1)] == [_ref(2, "a").key]  # a empties mid-turn
    assert "a" not in drr.keys and [k.name for k in _ring(drr)] == ["b"]
    drr.push(_ref(4, "a"), fresh=True)
    assert drr.keys["a"].deficit == 0 and [k.name for k in _ring(drr)] == ["b", "a"]
    assert drr.pick(None) is not None and drr.pick(None) is not None
    assert drr.ready_count == 0 and drr._head is None


def _seconds_per_removal(keys_count: int) -> float:
    """Seconds per key to take a ring of `keys_count` one-message keys apart from its tail
    end (the far end for a list that searches from the head), key by key."""
    drr = Drr(quantum=1)
    for n in range(keys_count):
        drr.push(_ref(n, f"k{n}"), fresh=True)
    ring = _ring(drr)
    started = time.perf_counter()
    for key in reversed(ring):
        drr._drop_key(key)
    assert drr.keys == {} and drr._head is None
    return (time.perf_counter() - started) / keys_count


def test_removing_a_key_costs_the_same_with_few_and_with_many_keys() -> None:
    """O(1) removal: with 50,000 keys a key costs about what it does with 1,000 (the margin
    is for caches and a busy machine); a removal that searches the ring costs thousands of
    times as much per key there."""
    small = min(_seconds_per_removal(1_000) for _ in range(5))
    large = min(_seconds_per_removal(50_000) for _ in range(3))
    assert large < 30 * small, (small, large)
