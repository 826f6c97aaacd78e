"""`fila.cluster.unknown`: names etcd did not know, remembered for a moment, at most so
many, forgotten when created through this node (in process, on a manual clock)."""

from __future__ import annotations

from fila.clock import ManualClock
from fila.cluster.unknown import UnknownQueues


def test_an_unknown_name_is_remembered_for_its_ttl_only() -> None:
    clock = ManualClock()
    unknown = UnknownQueues(clock, ttl_ms=1000)
    assert not unknown.known_unknown("q")
    unknown.note("q")
    clock.advance(999)
    assert unknown.known_unknown("q")
    clock.advance(1)
    assert not unknown.known_unknown("q"), "asked again once the moment has passed"
    assert len(unknown) == 0


def test_at_most_so_many_names_are_kept_the_oldest_giving_way() -> None:
    clock = ManualClock()
    unknown = UnknownQueues(clock, ttl_ms=1000, max_entries=3)
    for name in "abcd":
        unknown.note(name)
        clock.advance(1)
    assert len(unknown) == 3
    assert [unknown.known_unknown(n) for n in "abcd"] == [False, True, True, True]


def test_expired_names_are_dropped_as_new_ones_come() -> None:
    clock = ManualClock()
    unknown = UnknownQueues(clock, ttl_ms=1000)
    for n in range(100):
        unknown.note(f"old-{n}")
    clock.advance(1000)
    unknown.note("new")
    assert len(unknown) == 1


def test_a_name_created_here_is_forgotten_at_once() -> None:
    unknown = UnknownQueues(ManualClock())
    unknown.note("q")
    unknown.forget("q")
    assert not unknown.known_unknown("q")
