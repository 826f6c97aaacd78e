"""PeekMessages in-process: delayed and leased messages page in id order from a kept
key order, so a page costs the same over a small map and a large one; a page filtered
by fairness key passes over a bounded number of others' messages.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.core import CoreBroker, make_core

from fila.core import administration, key_order
from fila.core.key_order import KeyOrder
from fila.v1 import service_pb2

HOUR_MS = 3_600_000
EACH_KEY = "function on_enqueue(m) return { fairness_key = m.headers.k } end"


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def _key(n: int) -> bytes:
    return b"m" + n.to_bytes(16, "big")


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add"] * 8 + ["remove"] * 6 + ["clear"]),
            st.integers(0, 200),
            st.integers(1, 6),  # adds: this many keys from n up; removals: this many
        ),
        max_size=100,
    ),
    probes=st.lists(st.integers(-1, 210), min_size=1, max_size=4),
)
def test_a_key_order_pages_like_sorting_the_map_across_its_thresholds(
    ops: list[tuple[str, int, int]], probes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adds and removals that cross `SORTED_FROM` up and `UNSORTED_BELOW` down (made
    small here): after each, paging from any point gives the map's keys above it, in
    order, and the order is kept exactly while the map has been large."""
    monkeypatch.setattr(key_order, "SORTED_FROM", 8)
    monkeypatch.setattr(key_order, "UNSORTED_BELOW", 3)
    mapping: dict[bytes, None] = {}
    order = KeyOrder(mapping)
    kept = False
    for op, n, count in ops:
        for i in range(count if op != "clear" else 0):
            if op == "add" and _key(n + i) not in mapping:
                mapping[_key(n + i)] = None
                order.added(_key(n + i))
                kept = kept or len(mapping) >= 8
            elif op == "remove" and mapping:
                key = sorted(mapping)[(n + i) % len(mapping)]  # one that is there
                del mapping[key]
                order.removed(key)
                kept = kept and len(mapping) >= 3
        if op == "clear":
            mapping.clear()
            order.cleared()
            kept = False
        assert order.kept == kept
        for probe in probes:
            after = _key(probe) if probe >= 0 else b""
            assert list(order.after(after)) == sorted(k for k in mapping if k > after)


async def _delayed(
    core: CoreBroker, queue: str, count: int, key: str = "k", delay_ms: int = HOUR_MS
) -> list[str]:
    requests = [
        service_pb2.EnqueueRequest(queue=queue, payload=b"x", delay_ms=delay_ms, headers={"k": key})
        for _ in range(count)
    ]
    results, committed = core.broker.enqueue(requests)
    await committed
    return [r for r in results if isinstance(r, str)]


async def _seconds_per_page(core: CoreBroker, queue: str, pages: int) -> float:
    """The fastest of `pages` limit-1 pages, each after the last."""
    best, after = float("inf"), ""
    for _ in range(pages):
        started = time.perf_counter()
        page, after = await core.broker.peek(queue, 1, after, "")
        best = min(best, time.perf_counter() - started)
        assert len(page) == 1
    return best


def test_a_page_of_delayed_messages_costs_the_same_over_few_and_over_many() -> None:
    """A kept order: a limit-1 page over 20,000 delayed messages costs about what one
    over 300 does (sorting them per page made it about seventy times as much)."""

    async def scenario() -> None:
        core = make_core(queues=["few", "many"])
        await _delayed(core, "few", 300)
        ids = await _delayed(core, "many", 20_000)
        assert core.broker.queues["many"].delayed._order.kept
        page, after = await core.broker.peek("many", 3, "", "")
        assert [m.id for m in page] == ids[:3] and after == ids[2]
        page, after = await core.broker.peek("many", 2, ids[-3], "")
        assert [m.id for m in page] == ids[-2:] and after == ""
        few = await _seconds_per_page(core, "few", 30)
        many = await _seconds_per_page(core, "many", 30)
        assert many < 10 * few, (few, many)

    run(scenario)


def test_the_kept_order_follows_releases_purges_and_a_shrink_below_the_threshold() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        queue = core.broker.queues["q"]
        ids = await _delayed(core, "q", key_order.SORTED_FROM)
        assert queue.delayed._order.kept
        # a fresh delayed message, due soon: it is released, and the order follows
        soon = await _delayed(core, "q", 1, delay_ms=10)
        await core.advance(10)
        assert len(queue.delayed) == len(ids)
        delayed = administration.MessageState.DELAYED
        page, _, after = await core.broker.peek_states("q", 5, ids[-2], "", delayed)
        assert ([m.id for m in page], after) == ([ids[-1]], "")
        page, after = await core.broker.peek("q", 5, ids[-2], "")
        assert ([m.id for m in page], after) == ([ids[-1], *soon], "")  # ready now
        purged, committed = core.broker.purge("q")
        await committed
        assert purged == len(ids) + 1
        assert not queue.delayed._order.kept
        assert await core.broker.peek("q", 5, "", "") == ([], "")
        again = await _delayed(core, "q", 10)
        page, _ = await core.broker.peek("q", 20, "", "")
        assert [m.id for m in page] == again

    run(scenario)


def test_leases_page_in_id_order_while_many_and_after_most_are_acked() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        count = key_order.SORTED_FROM + 500
        ids = await core.enqueue("q", count)
        consumer = core.broker.attach_consumer("q", prefetch=count, max_batch=count)
        await core.settle()
        assert sorted(core.take(consumer)) == sorted(ids)
        queue = core.broker.queues["q"]
        assert queue.leases._order.kept

        async def leased_page(after: str, limit: int) -> tuple[list[str], str]:
            page, states, next_after = await core.broker.peek_states(
                "q", limit, after, "", administration.MessageState.LEASED
            )
            assert all(s.state == administration.MessageState.LEASED for s in states)
            return [m.id for m in page], next_after

        assert await leased_page("", 4) == (ids[:4], ids[3])
        assert await leased_page(ids[-3], 10) == (ids[-2:], "")
        results, committed = core.broker.ack([("q", i) for i in ids[: count - 100]])
        await committed
        assert results == [None] * (count - 100)
        assert not queue.leases._order.kept
        assert await leased_page("", 1000) == (ids[count - 100 :], "")

    run(scenario)


def test_a_filtered_page_passes_over_a_bounded_number_of_other_keys_messages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Delayed messages of key "b" behind 1,000 of key "a": with a scan bound of 300,
    pages come back short (even empty) with a next_after_id, and following them finds
    every "b" message, in order, having passed each "a" message once."""
    monkeypatch.setattr(administration, "PEEK_SCAN", 300)

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", EACH_KEY, "", 1000)
        await _delayed(core, "q", 1000, key="a")
        wanted = await _delayed(core, "q", 5, key="b")
        found: list[str] = []
        after, pages = "", 0
        while True:
            page, after = await core.broker.peek("q", 2, after, "b")
            pages += 1
            found += [m.id for m in page]
            assert all(m.metadata.fairness_key == "b" for m in page)
            if not after:
                break
        assert found == wanted
        assert pages == 1000 // 300 + 3  # three that stopped early, then 2 + 2 + 1

    run(scenario)


async def _ready_in_keys(core: CoreBroker, queue: str, keys: list[str]) -> list[str]:
    """Enqueues one message per entry of `keys` (its fairness key), in order; their ids."""
    requests = [
        service_pb2.EnqueueRequest(queue=queue, payload=b"x", headers={"k": key}) for key in keys
    ]
    results, committed = core.broker.enqueue(requests)
    await committed
    await core.settle()
    return [r for r in results if isinstance(r, str)]


def test_pages_over_many_fairness_keys_are_in_id_order_and_found_a_slice_per_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ready messages spread over 60 keys (several each, interleaved), with delayed
    and leased ones among them: paging by 7 gives every message once, in id order,
    while keys are looked at 5 per loop turn (the page waits; the loop does not)."""
    monkeypatch.setattr(administration, "PEEK_KEYS_PER_TURN", 5)

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", EACH_KEY, "", 60_000)
        ids = await _ready_in_keys(core, "q", [f"k{i % 60}" for i in range(300)])
        ids += await _delayed(core, "q", 20)
        consumer = core.broker.attach_consumer("q", prefetch=30, max_batch=30)
        await core.settle()
        assert len(core.take(consumer)) == 30
        turns = 0
        seen: list[str] = []
        after = ""
        while True:
            task = asyncio.create_task(core.broker.peek("q", 7, after, ""))
            while not task.done():
                await asyncio.sleep(0)
                turns += 1
            page, after = task.result()
            seen += [m.id for m in page]
            if not after:
                break
        assert seen == sorted(ids)
        assert turns >= (len(ids) // 7) * (60 // 5), "the keys were not looked at in slices"

    run(scenario)


def test_a_page_over_many_fairness_keys_costs_each_turn_the_same_as_over_few() -> None:
    """20,000 keys of one ready message each: no loop turn of a page does more than a
    slice of keys' work, about what a page over 300 keys costs (looking at every key in
    one turn made it about seventy times as much)."""

    async def scenario() -> None:
        core = make_core()
        for name in ("few", "many"):
            await core.broker.create_queue(name, EACH_KEY, "", 1000)
        await _ready_in_keys(core, "few", [f"k{i}" for i in range(300)])
        ids = await _ready_in_keys(core, "many", [f"k{i}" for i in range(20_000)])
        page, after = await core.broker.peek("many", 2, ids[5_000], "")
        assert [m.id for m in page] == ids[5_001:5_003] and after == ids[5_002]

        async def longest_turn(queue: str) -> float:
            """The CPU time of the longest loop turn a limit-1 page takes, the best of
            five (CPU time, and the collector held off: what the page's own work costs,
            not what a busy machine or a collection adds)."""
            best = float("inf")
            gc.disable()
            try:
                for _ in range(5):
                    task = asyncio.create_task(core.broker.peek(queue, 1, "", ""))
                    longest = 0.0
                    while not task.done():
                        started = time.thread_time()
                        await asyncio.sleep(0)
                        longest = max(longest, time.thread_time() - started)
                    best = min(best, longest)
            finally:
                gc.enable()
            return best

        few, many = await longest_turn("few"), await longest_turn("many")
        assert many < 20 * few, (few, many)

    run(scenario)


@settings(max_examples=200, deadline=None)
@given(
    pushed=st.lists(st.integers(0, 50), max_size=30, unique=True),
    popped=st.integers(0, 30),
    probes=st.lists(st.integers(-1, 51), min_size=1, max_size=5),
)
def test_a_keys_first_message_above_a_point_is_the_smallest_one_above_it(
    pushed: list[int], popped: int, probes: list[int]
) -> None:
    from fila.core.fairness_key import FairnessKey, ThrottleTable
    from fila.core.records import MessageRef

    key = FairnessKey("k", 1, ThrottleTable())
    for n in pushed:
        key.push(MessageRef(_key(n), "k", 1, (), 0))
    left = sorted(pushed)
    for _ in range(min(popped, len(left))):
        key.popleft()
        left.pop(0)
    for probe in probes:
        after = _key(probe) if probe >= 0 else b""
        above = [_key(n) for n in left if _key(n) > after]
        assert key.first_above(after) == (above[0] if above else None)
