"""Delays: messages enqueued with `delay_ms`, retries `on_failure` delays, and the timers
that make them ready on the broker's clock.

SPEC 1 (job-queue additions) and 2: a delayed message is stored at once, counts in
its queue's depth, and becomes ready when due; `on_failure`'s
`{action="retry", delay_ms=N}` makes a failed message ready again after N ms (0: at
once). A delay is stored beside the message (its due time), so it survives a
restart (tests/core/test_recovery.py).
"""

from __future__ import annotations

import asyncio
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st
from support.core import ManualClock, make_core, run_async

from fila.core import timers as timers_module
from fila.core.errors import InvalidArgument
from fila.core.timers import Timers
from fila.storage import keys
from fila.v1 import service_pb2

BACKOFF = """
function on_failure(m)
  return { action = "retry", delay_ms = 100 * 2 ^ (m.attempts - 1) }
end
"""
YEAR_MS = 366 * 24 * 3600 * 1000


@run_async
async def test_a_delayed_message_counts_in_depth_and_becomes_ready_at_its_due_time() -> None:
    core = make_core(queues=["q"])
    (later,) = await core.enqueue("q", delay_ms=5000)
    (now,) = await core.enqueue("q")
    consumer = await core.attach("q")
    assert core.take(consumer) == [now]
    assert core.depth("q") == (1, 1) and core.delayed("q") == 1
    await core.ack("q", now)
    await core.advance(4999)
    assert core.take(consumer) == []
    await core.advance(1)
    (message,) = core.receive(consumer)
    assert (message.id, message.metadata.attempt_count) == (later, 0)
    assert message.timestamps.leased_at.ToMilliseconds() == (
        message.timestamps.enqueued_at.ToMilliseconds() + 5000
    )
    assert core.delayed("q") == 0


@run_async
async def test_a_delay_is_stored_beside_its_message_until_it_is_due() -> None:
    core = make_core(queues=["q"])
    (message_id,) = await core.enqueue("q", delay_ms=1000)
    (side,) = core.stored(keys.DELAY)
    assert keys.message_key_from_side_key(side) == keys.MESSAGE + bytes.fromhex(
        message_id.replace("-", "")
    )
    await core.advance(1000)
    assert core.stored(keys.DELAY) == []
    assert core.stored_message(message_id) is not None


@run_async
async def test_a_delay_over_the_limit_is_refused_and_stores_nothing() -> None:
    core = make_core(queues=["q"])
    results = await core.enqueue_requests(
        [
            service_pb2.EnqueueRequest(queue="q", delay_ms=YEAR_MS + 1),
            service_pb2.EnqueueRequest(queue="q", delay_ms=YEAR_MS),
        ]
    )
    assert isinstance(results[0], InvalidArgument)
    assert isinstance(results[1], str)
    assert core.depth("q") == (1, 0) and core.delayed("q") == 1
    assert len(core.stored(keys.MESSAGE)) == 1


@run_async
async def test_messages_due_in_the_same_millisecond_all_become_ready_in_id_order() -> None:
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 50, delay_ms=250)
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    await core.advance(249)
    assert core.take(consumer) == []
    await core.advance(1)
    assert core.take(consumer) == ids


@run_async
async def test_an_on_failure_delay_holds_each_retry_for_its_time() -> None:
    core = make_core()
    await core.create_queue("q", on_failure=BACKOFF)
    (message_id,) = await core.enqueue("q", headers={"h": "v"})
    consumer = await core.attach("q")
    assert core.take(consumer) == [message_id]
    for attempt in range(1, 6):
        delay = 100 * 2 ** (attempt - 1)  # 100, 200, 400, 800, 1600
        await core.nack("q", message_id, error=f"fail {attempt}")
        assert core.depth("q") == (1, 0), "a pending retry counts in depth, not in flight"
        await core.advance(delay - 1)
        assert core.take(consumer) == [], attempt
        await core.advance(1)
        (again,) = core.receive(consumer)
        assert (again.id, again.metadata.attempt_count) == (message_id, attempt)
        assert dict(again.headers) == {"h": "v"}
    await core.ack("q", message_id)
    assert core.depth("q") == (0, 0)


@run_async
async def test_a_retry_with_no_delay_is_ready_at_once_with_or_without_a_hook() -> None:
    core = make_core()
    await core.create_queue("plain")
    await core.create_queue(
        "zero", on_failure='function on_failure(m) return { action = "retry" } end'
    )
    for queue in ("plain", "zero"):
        (message_id,) = await core.enqueue(queue)
        consumer = await core.attach(queue)
        core.take(consumer)
        await core.nack(queue, message_id)
        assert core.take(consumer) == [message_id], queue
        assert core.attempts(queue) == {message_id: 1}


@run_async
async def test_a_purged_delayed_message_never_comes_back() -> None:
    core = make_core(queues=["q"])
    await core.enqueue("q", delay_ms=1000)
    assert await core.purge("q") == 1
    assert core.stored(keys.DELAY) == [] and core.stored(keys.MESSAGE) == []
    consumer = await core.attach("q")
    await core.advance(1000)
    assert core.take(consumer) == [] and core.depth("q") == (0, 0)


@run_async
async def test_a_delayed_message_of_a_deleted_queue_does_not_come_back_in_its_namesake() -> None:
    core = make_core(queues=["q"])
    await core.enqueue("q", delay_ms=1000)
    await core.delete_queue("q")
    await core.create_queue("q")
    consumer = await core.attach("q")
    await core.advance(1000)
    assert core.take(consumer) == [] and core.depth("q") == (0, 0)
    assert core.stored(keys.DELAY) == [] and core.stored(keys.MESSAGE) == []


@run_async
async def test_a_mass_of_due_timers_runs_a_bounded_number_per_loop_turn() -> None:
    # Issue 29: a million delays due at once (or past due after a restart) must not
    # hold the loop; the loop-driven timers run PER_TURN entries a turn.
    clock = ManualClock()
    fired: list[int] = []
    timers = Timers(clock, lambda _: True)
    total = 2 * timers_module.PER_TURN + 5
    for n in range(total):
        timers.at(clock.now_ms(), fired.append, n)
    seen: list[int] = []
    while len(fired) < total:
        await asyncio.sleep(0)  # one turn: others run between the timers' turns
        seen.append(len(fired))
    steps = [b - a for a, b in zip([0, *seen], seen, strict=False)]
    assert max(steps) <= timers_module.PER_TURN
    assert len([step for step in steps if step]) >= 3
    assert fired == list(range(total))  # time order, then the order they were set
    timers.close()


def test_timers_fire_in_time_order_only_when_due() -> None:
    clock = ManualClock()
    fired: list[str] = []
    timers = Timers(clock, lambda _: True, loop_driven=False)
    start = clock.now_ms()
    for delay, name in ((300, "c"), (100, "a"), (200, "b"), (100, "a2")):
        timers.at(start + delay, fired.append, name)
    timers.run_due()
    assert fired == []
    clock.advance(150)
    timers.run_due()
    assert fired == ["a", "a2"]
    clock.advance(1000)
    timers.run_due()
    assert fired == ["a", "a2", "b", "c"]
    assert len(timers) == 0


# -- the timer heap's sweep of dead entries --------------------------------------------


@run_async
async def test_the_sweep_of_dead_timer_entries_moves_a_slice_per_loop_turn() -> None:
    # Issue 29: the heap's cleanup used to rebuild it in one turn, O(entries) (369 ms
    # for a million); now it moves SWEEP_SLICE entries a turn, others served between.
    clock = ManualClock()
    dead: set[int] = set()
    timers = Timers(clock, lambda n: n not in dead)
    total = timers_module._MIN_SWEEP + 1
    later = clock.now_ms() + 60_000
    for n in range(total - 1):
        timers.at(later, lambda _: None, n)
        dead.add(n)  # acked at once: its lease entry is dead
    timers.at(later, lambda _: None, "live")
    assert timers.sweeping
    left = [len(timers)]
    while timers.sweeping:
        await asyncio.sleep(0)  # one turn
        left.append(len(timers))
    moved = [a - b for a, b in itertools.pairwise(left)]
    assert max(moved) <= timers_module.SWEEP_SLICE
    assert len([m for m in moved if m]) >= total // timers_module.SWEEP_SLICE
    assert len(timers) == 1  # only the live entry is left
    timers.close()


@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("at"), st.integers(0, 50)),
            st.tuples(st.just("end"), st.integers(0, 200)),
            st.tuples(st.just("advance"), st.integers(0, 30)),
        ),
        max_size=200,
    )
)
@settings(max_examples=200, deadline=None)
def test_timers_fire_every_live_entry_once_in_order_through_sweeps(
    steps: list[tuple[str, int]],
) -> None:
    """Against a model: every entry whose subject is still live when it falls due fires
    once, never early, in (due time, order set) order, whatever sweeps run meanwhile
    (tiny slices and thresholds, so the sweeps interleave with everything); once a
    sweep ends, no entry that was dead when it was looked at is left."""
    original = timers_module._MIN_SWEEP, timers_module.SWEEP_SLICE
    timers_module._MIN_SWEEP, timers_module.SWEEP_SLICE = 4, 3
    try:
        clock = ManualClock()
        ended: set[int] = set()
        fired: list[tuple[int, int]] = []
        timers = Timers(clock, lambda subject: subject not in ended, loop_driven=False)
        pending: list[tuple[int, int]] = []  # (due, subject) set, in order
        for action, value in steps:
            if action == "at":
                subject = len(pending)
                due = clock.now_ms() + value
                pending.append((due, subject))

                def fire(subject: int, due: int = due) -> None:
                    assert clock.now_ms() >= due, "fired early"
                    if subject not in ended:
                        fired.append((due, subject))
                        ended.add(subject)  # done: its entry is dead from now on

                timers.at(due, fire, subject)
            elif action == "end":
                ended.add(value)
            else:
                clock.advance(value)
                timers.run_due()
        clock.advance(100)
        while timers.sweeping:
            timers.run_due()
        timers.run_due()
        expected = [(due, s) for due, s in pending if s not in ended or (due, s) in fired]
        assert fired == sorted(expected)
        assert len(timers) == 0
    finally:
        timers_module._MIN_SWEEP, timers_module.SWEEP_SLICE = original
