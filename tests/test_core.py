"""Fast in-process tests of the core: DRR, timers, leases, throttles, delays, the breaker.

They run the real broker on in-memory storage and a manual clock (`support.core`), so
they need no server process, never sleep, and move time explicitly.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, deque
from collections.abc import Awaitable, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.core import CoreBroker, make_core

from fila.clock import ManualClock
from fila.config import parse_config
from fila.core.drr import Drr
from fila.core.errors import MessageNotFound
from fila.core.records import MessageRef
from fila.core.throttle import Throttles, parse_throttle_value
from fila.core.timers import Timers
from fila.lua.hooks import LuaLimits, QueueHooks
from fila.storage import keys
from fila.v1 import service_pb2


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def _ref(n: int, key: str, weight: int = 1, throttle: tuple[str, ...] = ()) -> MessageRef:
    return MessageRef(keys.MESSAGE + n.to_bytes(16, "big"), key, weight, throttle, 0)


# -- DRR ---------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.integers(1, 8), min_size=1, max_size=8))
def test_drr_gives_each_backlogged_key_its_weight_share_in_every_window(
    weights: list[int],
) -> None:
    drr = Drr(quantum=1)
    per_key = 3000
    n = 0
    for _ in range(per_key):
        for k, weight in enumerate(weights):
            drr.push(_ref(n, f"k{k}", weight), fresh=True)
            n += 1
    total = sum(weights)
    window = 100 * total
    picks: deque[str] = deque(maxlen=window)
    counts: Counter[str] = Counter()
    # while every key is still backlogged: the heaviest key runs dry first
    for step in range(per_key * total // max(weights)):
        ref = drr.pick(None)
        assert ref is not None
        if len(picks) == window:
            counts[picks[0]] -= 1
        picks.append(ref.fairness_key)
        counts[ref.fairness_key] += 1
        if len(picks) == window and step % 97 == 0:
            for k, weight in enumerate(weights):
                share = counts[f"k{k}"] / window
                assert abs(share - weight / total) <= 0.01, (weights, k, share)


@settings(max_examples=40, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 5)), min_size=1, max_size=200))
def test_drr_keeps_fifo_within_a_key_and_loses_nothing(plan: list[tuple[int, int]]) -> None:
    drr = Drr(quantum=1)
    for n, (key, weight) in enumerate(plan):
        drr.push(_ref(n, f"k{key}", weight), fresh=True)
    picked: list[MessageRef] = []
    while (ref := drr.pick(None)) is not None:
        picked.append(ref)
    assert len(picked) == len(plan) and drr.ready_count == 0
    for key in {f"k{k}" for k, _ in plan}:
        mine = [r.key for r in picked if r.fairness_key == key]
        assert mine == sorted(mine)


def test_drr_parks_a_throttled_key_and_serves_the_others() -> None:
    drr = Drr(quantum=1)
    for n in range(10):
        drr.push(_ref(n, "slow", throttle=("t",)), fresh=True)
        drr.push(_ref(100 + n, "fast"), fresh=True)
    allowed = {"t": 2}

    def has_tokens(throttle_keys: tuple[str, ...]) -> bool:
        if allowed["t"] == 0:
            return False
        allowed["t"] -= 1
        return True

    order = [ref.fairness_key for ref in iter(lambda: drr.pick(has_tokens), None)]
    assert order.count("slow") == 2 and order.count("fast") == 10
    assert drr.ready_count == 8
    assert drr.unpark_all()
    allowed["t"] = 100
    assert [r.fairness_key for r in iter(lambda: drr.pick(has_tokens), None)] == ["slow"] * 8


# -- timers and throttles ------------------------------------------------------------------


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


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    clock = ManualClock()
    throttles = Throttles(clock)
    throttles.configure("t", rate=10.0, burst=3.0)
    assert [throttles.try_take(("t",)) for _ in range(4)] == [True, True, True, False]
    assert throttles.seconds_until_available(("t",)) == pytest.approx(0.1)
    clock.advance(101)
    assert throttles.try_take(("t",)) and not throttles.try_take(("t",))
    clock.advance(10_000)
    assert sum(throttles.try_take(("t",)) for _ in range(10)) == 3
    assert throttles.try_take(("unlimited",))


# -- the broker: delivery, leases, delays, storage writes ---------------------------------


@pytest.mark.parametrize("value", ["20,5", "0.5,1", " .25 , 2 ", "1e3,10", "+3,1."])
def test_throttle_values_are_decimal_rate_and_burst(value: str) -> None:
    rate, burst = (float(part) for part in value.split(","))
    assert parse_throttle_value(value) == (rate, burst)


@pytest.mark.parametrize("value", ["1_0,1", "nan,1", "inf,1", "1,infinity", "0x10,1", "1,2,3", "1"])
def test_throttle_values_refuse_what_is_not_a_plain_number(value: str) -> None:
    with pytest.raises(ValueError):
        parse_throttle_value(value)


def test_a_lease_expires_on_the_clock_and_the_message_comes_back_counted() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        (message_id,) = await core.enqueue("q")
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        assert core.take(consumer) == [message_id]
        queue = core.broker.queues["q"]
        assert len(queue.leases) == 1
        await core.advance(999)
        assert len(queue.leases) == 1
        await core.advance(2)
        # expired: ready again with attempt 1, and delivered again to the consumer
        assert core.take(consumer) == [message_id]
        (lease,) = queue.leases
        assert lease.ref.attempt_count == 1
        assert queue.counters.expired == 1

    run(scenario)


def test_ack_ends_the_lease_and_deletes_message_and_lease_records() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        (message_id,) = await core.enqueue("q")
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        core.take(consumer)
        raw = keys.MESSAGE + bytes.fromhex(message_id.replace("-", ""))
        assert core.storage.get(keys.lease_key(raw)) is not None
        results, committed = core.broker.ack([("q", message_id)])
        await committed
        assert results == [None]
        assert core.storage.get(raw) is None and core.storage.get(keys.lease_key(raw)) is None
        assert consumer.unsettled == 0
        results, _ = core.broker.ack([("q", message_id)])
        assert isinstance(results[0], MessageNotFound)

    run(scenario)


def test_a_batch_frame_records_its_leases_in_one_write() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        ids = await core.enqueue("q", 10)
        consumer = core.broker.attach_consumer("q", prefetch=10, max_batch=10)
        await core.settle()
        writes = core.storage.writes
        assert core.take(consumer) == ids
        assert core.storage.writes == writes + 1  # one WAL append for the frame of ten

    run(scenario)


def test_delivered_counts_the_messages_sent_not_those_only_buffered() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        await core.enqueue("q", 5)
        consumer = core.broker.attach_consumer("q", prefetch=5, max_batch=2)
        await core.settle()
        assert consumer.unsettled == 5  # all five leased into the stream's buffer
        assert core.broker.sending(consumer, 2) is not None  # one frame of two
        core.broker.detach_consumer(consumer)  # three go back, never sent
        queue = core.broker.queues["q"]
        assert queue.counters.delivered == 2
        assert queue.key_deliveries == {"default": 2}
        assert sum(queue.latency.counts) == 2  # fila.delivery.latency: first deliveries sent

    run(scenario)


async def _budget_spent_by_a_stream_that_never_sends() -> CoreBroker:
    """Queues "a" and "b"; a stream on "a" holds the whole (2 KB) buffer budget."""
    config = parse_config("[scheduler]\ntotal_buffer_bytes = 2048\n", "test")
    core = make_core(queues=["a", "b"], config=config)
    big = [service_pb2.EnqueueRequest(queue="a", payload=bytes(1500)) for _ in range(3)]
    _, committed = core.broker.enqueue(big)
    await committed
    core.broker.attach_consumer("a", prefetch=10)  # a stream that never sends
    await core.settle()
    assert core.broker.buffers.exhausted
    return core


def test_a_stream_that_sends_what_it_gets_is_served_while_unread_streams_spend_the_budget() -> None:
    async def scenario() -> None:
        core = await _budget_spent_by_a_stream_that_never_sends()
        reading = core.broker.attach_consumer("b", prefetch=10, max_batch=10)
        ids = await core.enqueue("b", 5)
        received: list[str] = []
        for _ in range(10):
            received += core.take(reading)
            await core.settle()
        assert received == ids, "served one message at a time, not stalled"
        assert core.broker.buffers.exhausted, "the unread stream keeps what it holds"

    run(scenario)


def test_deleting_a_queue_whose_streams_spent_the_buffer_budget_unblocks_the_others() -> None:
    async def scenario() -> None:
        core = await _budget_spent_by_a_stream_that_never_sends()
        waiting = core.broker.attach_consumer("b", prefetch=10, max_batch=10)
        ids = await core.enqueue("b", 2)
        # With the budget spent, a stream holds one unsent message at most.
        assert waiting.unsettled == 1
        await core.broker.delete_queue("a")
        await core.settle()
        assert not core.broker.buffers.exhausted
        assert waiting.unsettled == 2, "the budget back, the rest is buffered at once"
        assert core.take(waiting) == ids

    run(scenario)


def test_a_frame_counts_against_the_buffer_budget_until_it_is_written() -> None:
    """gRPC holds a frame until the client's window lets it out: its messages stay
    counted, for the stream and the broker, until the write returned (`sent`)."""

    async def scenario() -> None:
        config = parse_config("[scheduler]\nstream_buffer_bytes = 3000\n", "test")
        core = make_core(queues=["q"], config=config)
        big = [service_pb2.EnqueueRequest(queue="q", payload=bytes(1000)) for _ in range(10)]
        _, committed = core.broker.enqueue(big)
        await committed
        delivery = core.broker
        consumer = delivery.attach_consumer("q", prefetch=100, max_batch=100)
        await core.settle()
        buffered = consumer.buffered_bytes
        assert 3000 <= buffered < 4200 and consumer.unsettled == 3, "the stream is full"
        assert delivery.sending(consumer, 100) is not None  # handed to gRPC, not written
        await core.settle()
        assert (consumer.buffered_bytes, consumer.held_bytes) == (0, buffered)
        assert core.broker.buffers.bytes == buffered, "still the broker's"
        assert consumer.unsettled == 3, "a stream whose frame is not out gets no more"
        delivery.sent(consumer)
        await core.settle()
        assert consumer.unsettled == 6, "written: room for more"
        assert consumer.held_bytes == core.broker.buffers.bytes == consumer.buffered_bytes

    run(scenario)


def test_prefetch_bounds_unsettled_messages_per_consumer() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        ids = await core.enqueue("q", 10)
        consumer = core.broker.attach_consumer("q", prefetch=3, max_batch=10)
        await core.settle()
        assert core.take(consumer) == ids[:3]
        assert core.take(consumer) == []
        _, committed = core.broker.ack([("q", ids[0])])
        await committed
        await core.settle()
        assert core.take(consumer) == ids[3:4]

    run(scenario)


def test_a_delayed_message_becomes_ready_when_due_on_the_clock() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        (later,) = await core.enqueue("q", delay_ms=5000)
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        assert core.take(consumer) == []
        assert core.broker.queues["q"].depth == 1
        await core.advance(4999)
        assert core.take(consumer) == []
        await core.advance(1)
        assert core.take(consumer) == [later]

    run(scenario)


def test_a_nack_with_a_retry_delay_waits_on_the_clock() -> None:
    async def scenario() -> None:
        core = make_core()
        core.broker.create_queue(
            "q", "", 'function on_failure(m) return { action = "retry", delay_ms = 2000 } end', 0
        )
        (message_id,) = await core.enqueue("q")
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        core.take(consumer)
        _, committed = core.broker.nack([("q", message_id, "boom")])
        await committed
        await core.settle()
        assert core.take(consumer) == []
        await core.advance(2000)
        assert core.take(consumer) == [message_id]

    run(scenario)


def test_a_throttled_queue_wakes_when_tokens_refill() -> None:
    async def scenario() -> None:
        core = make_core()
        core.broker.create_queue(
            "q", 'function on_enqueue(m) return { throttle_keys = { "t" } } end', "", 0
        )
        await core.broker.set_config("throttle.t", "2,1")
        ids = await core.enqueue("q", 3)
        consumer = core.broker.attach_consumer("q", prefetch=10, max_batch=10)
        await core.settle()
        assert core.take(consumer) == ids[:1]
        await core.advance(499)
        assert core.take(consumer) == []
        await core.advance(2)
        assert core.take(consumer) == ids[1:2]

    run(scenario)


def test_sync_mode_answers_only_after_a_sync() -> None:
    """The enqueue's answer waits for the fsync of its write: with the sync held on the
    fsync thread, the answer stays pending however long the loop runs."""

    async def scenario() -> None:
        core = make_core(persist_mode="sync", queues=["q"])
        await core.settle()
        started, release = threading.Event(), threading.Event()
        sync = core.storage.sync

        def held_sync() -> None:
            started.set()
            release.wait(10)
            sync()

        core.storage.sync = held_sync  # type: ignore[method-assign]
        syncs = core.storage.sync_count
        _, committed = core.broker.enqueue([service_pb2.EnqueueRequest(queue="q")])
        assert await asyncio.to_thread(started.wait, 10), "no sync started"
        for _ in range(20):  # every turn the loop could take to answer early
            await asyncio.sleep(0)
        assert not committed.done(), "answered before its write was synced"
        release.set()
        await committed
        assert core.storage.sync_count == syncs + 1

    run(scenario)


def test_purge_and_peek_see_the_same_messages() -> None:
    async def scenario() -> None:
        core: CoreBroker = make_core(queues=["q"])
        ids = await core.enqueue("q", 5)
        page, after = core.broker.peek("q", 3, "", "")
        assert [m.id for m in page] == ids[:3] and after == ids[2]
        count, committed = core.broker.purge("q")
        await committed
        assert count == 5 and core.broker.queues["q"].depth == 0
        assert core.broker.peek("q", 10, "", "") == ([], "")

    run(scenario)


# -- the Lua circuit breaker -------------------------------------------------------------


def test_the_breaker_bypasses_a_failing_hook_for_its_cooldown() -> None:
    clock = ManualClock()
    limits = LuaLimits(
        timeout_ms=10, memory_limit_bytes=1 << 20, breaker_threshold=3, breaker_cooldown_ms=1000
    )
    hooks = QueueHooks(
        "q",
        'function on_enqueue(m) if m.headers.fail then error("boom") end '
        'return { fairness_key = "ok" } end',
        "",
        limits,
        lambda _key: None,
        clock,
    )
    for _ in range(3):
        assert hooks.on_enqueue({"fail": "1"}, 0).fairness_key == "default"
    counters = hooks.counters()["on_enqueue"]
    assert (counters.failed, counters.bypassed) == (3, 0)
    assert hooks.on_enqueue({}, 0).fairness_key == "default"  # open: bypassed
    assert counters.bypassed == 1
    clock.advance(1000)
    assert hooks.on_enqueue({}, 0).fairness_key == "ok"  # closed again


def test_a_throttle_wake_returns_only_the_keys_that_are_due() -> None:
    async def scenario() -> None:
        core = make_core()
        core.broker.create_queue(
            "q",
            "function on_enqueue(m) return { fairness_key = m.headers.k, "
            "throttle_keys = { m.headers.k } } end",
            "",
            0,
        )
        for i in range(100):
            rate = "10,1" if i % 2 == 0 else "1,1"
            await core.broker.set_config(f"throttle.k{i}", rate)
            await core.enqueue("q", 2, headers={"k": f"k{i}"})
        consumer = core.broker.attach_consumer("q", prefetch=1000, max_batch=1000)
        await core.settle()
        assert len(core.take(consumer)) == 100  # one per key, then every key is parked
        queue = core.broker.queues["q"]
        assert len(queue.throttle_wakes) == 100
        await core.advance(102)  # the 10/s keys have a token again; the 1/s ones do not
        assert len(core.take(consumer)) == 50
        assert len(queue.throttle_wakes) == 50
        await core.advance(900)
        assert len(core.take(consumer)) == 50

    run(scenario)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.integers(0, 2_000), st.integers(0, 3), st.integers(0, 2)),
            st.tuples(st.just("pop"), st.just(0), st.just(0), st.just(0)),
        ),
        max_size=300,
    )
)
def test_a_packed_fairness_key_behaves_like_a_sorted_list_of_refs(
    ops: list[tuple[str, int, int, int]],
) -> None:
    from fila.core.fairness_key import FairnessKey, ThrottleTable

    key = FairnessKey("k", 1, ThrottleTable())
    model: dict[int, tuple[int, tuple[str, ...]]] = {}
    throttles = [(), ("a",), ("a", "b")]
    for op, n, attempts, throttle in ops:
        if op == "push" and n not in model:
            key.push(_ref_with(n, attempts, throttles[throttle]))
            model[n] = (attempts, throttles[throttle])
        elif op == "pop" and model:
            first = min(model)
            ref = key.popleft()
            assert ref.key == _ref(first, "k").key
            assert (ref.attempt_count, ref.throttle_keys) == model.pop(first)
        assert len(key) == len(model)
        assert [r.key for r in key.iter_from()] == [_ref(n, "k").key for n in sorted(model)]
        if model:
            assert key.head_throttle_keys() == model[min(model)][1]
    middle = _ref(1_000, "k").key
    assert [r.key for r in key.iter_from(middle)] == [
        _ref(n, "k").key for n in sorted(model) if n > 1_000
    ]


def _ref_with(n: int, attempts: int, throttle: tuple[str, ...]) -> MessageRef:
    ref = _ref(n, "k", throttle=throttle)
    ref.attempt_count = attempts
    return ref
