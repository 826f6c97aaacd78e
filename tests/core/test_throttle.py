"""Throttling: token buckets per throttle key, on the broker's clock.

SPEC 2, Throttling: `throttle.<key>` = "<rate>,<burst>" defines a bucket; a message
is delivered only when every one of its throttle keys has a token, and delivery
takes one from each; a key with no bucket is unlimited; other keys keep flowing.
A fairness key whose next message lacks a token is parked and woken when its tokens
can be there (within a millisecond), so time here moves a millisecond at a time
where the exact moment matters.

Messages take their fairness key from the `fk` header and their throttle keys from
the comma-separated `th` header.
"""

from __future__ import annotations

import pytest
from support.core import CoreBroker, ManualClock, config, make_core, run_async

from fila.core.consumers import Consumer
from fila.core.drr import Drr
from fila.core.records import MessageRef
from fila.core.throttle import Throttles, parse_throttle_value
from fila.storage import keys
from fila.v1 import service_pb2

KEYS_FROM_HEADERS = """
function on_enqueue(m)
  local throttle = {}
  for k in string.gmatch(m.headers.th or "", "[^,]+") do throttle[#throttle + 1] = k end
  return { fairness_key = m.headers.fk or "default", throttle_keys = throttle }
end
"""


async def _throttled(core: CoreBroker, **buckets: str) -> None:
    """Queue "q" with the header-driven hook, and `throttle.<key>` set for each bucket."""
    await core.create_queue("q", on_enqueue=KEYS_FROM_HEADERS)
    for key, value in buckets.items():
        await core.set_config(f"throttle.{key}", value)


async def _backlog(core: CoreBroker, count: int, th: str, fk: str = "default") -> list[str]:
    return await core.enqueue_each("q", [{"th": th, "fk": fk}] * count)


async def _received_each_ms(core: CoreBroker, consumer: Consumer, ms: int) -> list[tuple[int, str]]:
    """(ms from now, fairness key) of every delivery over the next `ms` milliseconds,
    moving time one millisecond at a time and acking each delivery at once."""
    start = core.now_ms()
    got: list[tuple[int, str]] = []
    for step in range(ms + 1):
        if step:
            await core.advance(1)
        frame = core.receive(consumer)
        got += [(core.now_ms() - start, m.metadata.fairness_key) for m in frame]
        if frame:
            await core.ack("q", *(m.id for m in frame))
    return got


# -- buckets on the manual clock ------------------------------------------------------------


def _assert_paced(times: list[int], per_second: float, *, origin: int = 0) -> None:
    """The n-th of `times` (from 1) comes when the n-th token since `origin` is there:
    not before, and within the millisecond after (when the parked key is woken)."""
    for n, at in enumerate(times, start=1):
        due = origin + n * 1000 / per_second
        assert due <= at <= due + 1, (n, at, due)


@run_async
async def test_a_bucket_of_20_per_second_and_burst_5_lets_5_out_at_once_then_one_each_50_ms() -> (
    None
):
    core = make_core()
    await _throttled(core, t="20,5")
    await _backlog(core, 200, "t")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    times = [ms for ms, _ in await _received_each_ms(core, consumer, 2000)]
    assert times[:5] == [0] * 5, "the burst goes out at once"
    assert len(times[5:]) == 40
    _assert_paced(times[5:], 20)


@run_async
async def test_a_bucket_of_burst_1_paces_its_key_at_its_rate() -> None:
    core = make_core()
    await _throttled(core, t="50,1")
    await _backlog(core, 100, "t")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    times = [ms for ms, _ in await _received_each_ms(core, consumer, 1000)]
    assert times[0] == 0
    assert len(times[1:]) == 50
    _assert_paced(times[1:], 50)


@run_async
async def test_a_bucket_of_1000_per_second_lets_its_key_out_every_millisecond() -> None:
    """A parked key wakes in the first millisecond its token is there, not the one after;
    each time it is held back counts in `throttled`."""
    core = make_core()
    await _throttled(core, t="1000,1")
    await _backlog(core, 30, "t")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    times = [ms for ms, _ in await _received_each_ms(core, consumer, 20)]
    assert times == list(range(21))
    assert core.stats("q").counters.throttled == 21


@run_async
async def test_a_throttled_key_does_not_hold_back_keys_that_are_not_throttled() -> None:
    core = make_core()
    await _throttled(core, slow="2,2")
    await _backlog(core, 30, "slow", fk="slowtenant")
    await _backlog(core, 50, "", fk="fasttenant")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    got = [key for _, key in await _received_each_ms(core, consumer, 0)]
    assert (got.count("fasttenant"), got.count("slowtenant")) == (50, 2)
    got_later = await _received_each_ms(core, consumer, 1001)
    assert {key for _, key in got_later} == {"slowtenant"}
    _assert_paced([ms for ms, _ in got_later], 2)


@run_async
async def test_a_slow_buckets_wake_up_does_not_delay_a_faster_buckets_key() -> None:
    core = make_core()
    await _throttled(core, crawl="0.2,1", quick="20,2")
    await _backlog(core, 3, "crawl", fk="crawler")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    assert [key for _, key in await _received_each_ms(core, consumer, 10)] == ["crawler"]
    # the queue now waits 5 s for the crawler's next token; a faster key arrives
    await _backlog(core, 20, "quick", fk="runner")
    got = await _received_each_ms(core, consumer, 901)
    assert [key for _, key in got] == ["runner"] * 20
    times = [ms for ms, _ in got]
    assert times[:2] == [0, 0]
    _assert_paced(times[2:], 20)


@run_async
async def test_raising_a_rate_at_runtime_takes_effect_at_once() -> None:
    core = make_core()
    await _throttled(core, c="0.5,2")  # a token every 2 s
    await _backlog(core, 80, "c")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    assert len(await _received_each_ms(core, consumer, 1500)) == 2, "the burst only"
    await core.set_config("throttle.c", "50,2")  # 0.75 tokens kept: the next in 5 ms
    times = [ms for ms, _ in await _received_each_ms(core, consumer, 1000)]
    assert len(times) == 50
    _assert_paced(times, 50, origin=5 - 20)  # the first 5 ms after the change, then each 20 ms


@run_async
async def test_lowering_a_rate_at_runtime_takes_effect_at_once() -> None:
    core = make_core()
    await _throttled(core, l="50,2")
    await _backlog(core, 100, "l")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    assert len(await _received_each_ms(core, consumer, 200)) == 12
    await core.set_config("throttle.l", "2,2")  # the token just spent: the next in 500 ms
    times = [ms for ms, _ in await _received_each_ms(core, consumer, 2001)]
    assert len(times) == 4
    _assert_paced(times, 2)


@run_async
async def test_removing_a_throttle_releases_its_backlog_at_once() -> None:
    core = make_core()
    await _throttled(core, r="1,1")
    await _backlog(core, 60, "r")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    assert len(core.receive(consumer)) == 1
    await core.set_config("throttle.r", "")
    assert len(core.receive(consumer)) == 59
    assert core.stats("q").per_throttle == []


@run_async
async def test_a_key_parked_while_the_consumers_fill_up_still_wakes_on_time() -> None:
    """The pump parks a throttled key, serves another key until its consumers are
    full, and still schedules the parked key's wake-up for when its token is there."""
    core = make_core()
    await _throttled(core, t="10,1")
    await _backlog(core, 3, "t", fk="slow")
    await _backlog(core, 300, "", fk="free")  # keeps the consumer full for 300 ms
    consumer = await core.attach("q", prefetch=1, max_batch=1)
    got = await _received_each_ms(core, consumer, 250)
    slow = [ms for ms, key in got if key == "slow"]
    assert slow[0] == 0 and len(slow) == 3
    _assert_paced(slow[1:], 10)


@run_async
async def test_a_key_parked_while_the_buffer_budget_is_spent_still_wakes_on_time() -> None:
    """The same with the broker-wide buffer budget spent (by an unread stream on
    another queue): the pump parks the throttled key, serves a reading stream one
    message, stops on the budget, and still schedules the wake-up, rather than leaving
    it to the next pump that ends on its own, which a steady backlog of another key
    keeps from happening."""
    core = make_core(config=config("[scheduler]\ntotal_buffer_bytes = 2048\n"))
    await _throttled(core, t="10,1")
    await core.create_queue("a")
    await core.enqueue_requests(
        [service_pb2.EnqueueRequest(queue="a", payload=bytes(1500)) for _ in range(2)]
    )
    await core.attach("a", prefetch=10)  # never reads: holds the whole budget
    assert core.budget()[1], "spent"
    await _backlog(core, 2, "t", fk="slow")
    await _backlog(core, 400, "", fk="free")
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    got = await _received_each_ms(core, consumer, 150)
    slow = [ms for ms, key in got if key == "slow"]
    free = [ms for ms, key in got if key == "free"]
    assert len(free) > 100, "served one message at a time, not stalled"
    # its token is there at 100 ms; the reading stream's one slot may hold that
    # millisecond's message first
    assert len(slow) == 2 and slow[0] == 0 and 100 <= slow[1] <= 101, slow


@run_async
async def test_after_a_purge_a_throttled_key_parks_and_wakes_as_before() -> None:
    """The purged key's wake-up finds it gone; a new backlog of the key is paced anew."""
    core = make_core()
    await _throttled(core, t="1,1")
    await _backlog(core, 3, "t")
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    assert len(core.receive(consumer)) == 1  # the burst; the key parks, to wake in 1 s
    assert await core.purge("q") == 2
    await core.advance(1000)
    await _backlog(core, 3, "t")
    times = [ms for ms, _ in await _received_each_ms(core, consumer, 2000)]
    assert times == [0, 1000, 2000]


@run_async
async def test_a_message_with_two_throttle_keys_needs_a_token_from_each() -> None:
    core = make_core()
    await _throttled(core, a="100,2", b="2,2")
    # the slow key named first in one fairness key, second in the other
    await _backlog(core, 15, "a,b", fk="ab")
    await _backlog(core, 15, "b,a", fk="ba")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    got = await _received_each_ms(core, consumer, 3001)
    # b (burst 2, then a token each 500 ms) bounds them all: a's 100/s does not matter
    times = [ms for ms, _ in got]
    assert times[:2] == [0, 0] and len(times) == 8
    _assert_paced(times[2:], 2)
    assert {key for _, key in got} == {"ab", "ba"}


@run_async
async def test_stats_report_each_buckets_tokens_rate_and_burst() -> None:
    core = make_core()
    await _throttled(core, p="0.01,10", q="0.01,10", free="3.5,2")

    def buckets() -> dict[str, tuple[float, float, float]]:
        return {
            t.key: (round(t.tokens, 3), t.rate_per_second, t.burst)
            for t in core.stats("q").per_throttle
        }

    # no ready message uses a bucket: every bucket is listed
    assert buckets() == {"p": (10, 0.01, 10), "q": (10, 0.01, 10), "free": (2, 3.5, 2)}
    await _backlog(core, 4, "p,q")
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    assert len(core.receive(consumer)) == 4
    assert buckets() == {"p": (6, 0.01, 10), "q": (6, 0.01, 10), "free": (2, 3.5, 2)}
    await _backlog(core, 10, "p")
    assert len(core.receive(consumer)) == 6, "6 tokens left"
    # ready messages wait on p: only the buckets they use are listed
    assert buckets() == {"p": (0, 0.01, 10)}
    assert core.depth("q") == (4, 10)


@run_async
async def test_a_throttled_queue_wakes_when_tokens_refill() -> None:
    core = make_core()
    await core.create_queue(
        "q", on_enqueue='function on_enqueue(m) return { throttle_keys = { "t" } } end'
    )
    await core.set_config("throttle.t", "2,1")
    ids = await core.enqueue("q", 3)
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    assert core.take(consumer) == ids[:1]
    await core.advance(499)
    assert core.take(consumer) == []
    await core.advance(2)
    assert core.take(consumer) == ids[1:2]


@run_async
async def test_a_throttle_wake_returns_only_the_keys_that_are_due() -> None:
    core = make_core()
    await core.create_queue(
        "q",
        on_enqueue="function on_enqueue(m) return { fairness_key = m.headers.k, "
        "throttle_keys = { m.headers.k } } end",
    )
    for i in range(100):
        rate = "10,1" if i % 2 == 0 else "1,1"
        await core.set_config(f"throttle.k{i}", rate)
        await core.enqueue("q", 2, headers={"k": f"k{i}"})
    consumer = await core.attach("q", prefetch=1000, max_batch=1000)
    assert len(core.take(consumer)) == 100  # one per key, then every key is parked
    assert core.throttle_wakes("q") == 100
    assert core.stats("q").counters.throttled == 100
    await core.advance(102)  # the 10/s keys have a token again; the 1/s ones do not
    assert len(core.take(consumer)) == 50
    assert core.throttle_wakes("q") == 50
    assert core.stats("q").counters.throttled == 100, "the 1/s keys were left parked"
    await core.advance(900)
    assert len(core.take(consumer)) == 50


# -- the bucket, the ring's parking and the value syntax, alone ------------------------------


def test_a_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
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


def test_a_retuned_bucket_keeps_its_tokens_up_to_the_new_burst() -> None:
    clock = ManualClock()
    throttles = Throttles(clock)
    throttles.configure("t", rate=1.0, burst=10.0)
    assert sum(throttles.try_take(("t",)) for _ in range(4)) == 4
    throttles.configure("t", rate=1.0, burst=20.0)
    assert sum(throttles.try_take(("t",)) for _ in range(30)) == 6, "6 left, not refilled"
    throttles.configure("t", rate=1.0, burst=3.0)
    clock.advance(60_000)
    assert sum(throttles.try_take(("t",)) for _ in range(30)) == 3


def _ref(n: int, key: str, throttle: tuple[str, ...] = ()) -> MessageRef:
    return MessageRef(keys.MESSAGE + n.to_bytes(16, "big"), key, 1, throttle, 0)


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


def test_a_key_back_from_parking_is_an_ordinary_ring_key_again() -> None:
    """`unpark_all` and `unpark` return a parked key to the ring (True only if one was
    parked); taken out afterwards (a redrive empties it), it leaves the ring cleanly."""
    for unpark_all in (True, False):
        drr = Drr(quantum=1)
        refs = [_ref(n, "slow", throttle=("t",)) for n in range(3)]
        for ref in refs:
            drr.push(ref, fresh=True)
        assert drr.pick(lambda throttle_keys: False) is None
        parked = drr.take_newly_parked()
        assert [key.name for key in parked] == ["slow"]
        if unpark_all:
            assert drr.unpark_all()
            assert not drr.unpark_all(), "nothing is parked any more"
        else:
            assert drr.unpark(parked)
            assert not drr.unpark(parked), "it is no longer parked"
        assert [ref.key for ref in drr.take(10)] == [ref.key for ref in refs]
        assert (drr.keys, drr.ready_count, drr.pick(None)) == ({}, 0, None)


def test_drr_take_and_upcoming_reach_the_parked_keys_after_the_ring() -> None:
    """What redrive relies on: `upcoming` lists the ready messages in the order `take`
    takes them, parked keys last (in the order they were parked), and `take` stops at
    its limit; a key it empties is gone, parked or not, with no wake-up left to ask for."""
    drr = Drr(quantum=1)
    parked = [_ref(n, f"p{n % 2}", throttle=("t",)) for n in range(4)]  # p0, p1, p0, p1
    for ref in parked:
        drr.push(ref, fresh=True)
    assert drr.pick(lambda throttle_keys: False) is None  # p0 and p1 park
    free = [_ref(10 + n, "free") for n in range(2)]
    for ref in free:
        drr.push(ref, fresh=True)
    order = [ref.key for ref in free + parked[0::2] + parked[1::2]]
    assert [ref.key for ref in drr.upcoming()] == order
    assert [ref.key for ref in drr.take(3)] == order[:3]
    assert [ref.key for ref in drr.upcoming()] == order[3:]
    assert [ref.key for ref in drr.take(10)] == order[3:]
    assert (drr.keys, drr.ready_count, drr.take_newly_parked()) == ({}, 0, [])


@pytest.mark.parametrize("value", ["20,5", "0.5,1", " .25 , 2 ", "1e3,10", "+3,1."])
def test_throttle_values_are_decimal_rate_and_burst(value: str) -> None:
    rate, burst = (float(part) for part in value.split(","))
    assert parse_throttle_value(value) == (rate, burst)


@pytest.mark.parametrize("value", ["1_0,1", "nan,1", "inf,1", "1,infinity", "0x10,1", "1,2,3", "1"])
def test_throttle_values_refuse_what_is_not_a_plain_number(value: str) -> None:
    with pytest.raises(ValueError):
        parse_throttle_value(value)
