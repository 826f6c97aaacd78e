"""Throttling on a driven clock: token-bucket accuracy, isolation between keys, runtime
rate changes and removal, multi-key messages, and buckets after a restart.

The real broker runs in-process (`support.core`) and time moves only when a test
moves it, so every count below is exact: what a rate promises, not what a loaded
machine happened to deliver. tests/test_throttle.py keeps what needs a real server
(the gRPC stats and persistence across kill -9). Every message's throttle keys come
from the queue's `on_enqueue`, read from the `th` header as a comma-separated list;
its fairness key from the `fk` header.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

from support.core import CoreBroker, make_core, restarted

from fila.core.consumers import Consumer

ON_ENQUEUE = """
function on_enqueue(m)
  local keys = {}
  for k in string.gmatch(m.headers.th or "", "[^,]+") do keys[#keys + 1] = k end
  return { fairness_key = m.headers.fk or "default", throttle_keys = keys }
end
"""
STEP_MS = 1  # the clock moves a millisecond at a time, as finely as the timers work


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


async def _queue(*throttles: tuple[str, str]) -> CoreBroker:
    core = make_core()
    await core.broker.create_queue("q", ON_ENQUEUE, "", 0)
    for key, value in throttles:
        await _set(core, key, value)
    return core


async def _set(core: CoreBroker, key: str, value: str) -> None:
    await core.broker.set_config(f"throttle.{key}", value)
    await core.settle()


async def _backlog(core: CoreBroker, count: int, th: str, fk: str = "default") -> list[str]:
    return await core.enqueue("q", count, headers={"th": th, "fk": fk})


def _consumer(core: CoreBroker) -> Consumer:
    """A consumer that never runs out of room: only the throttles hold messages back."""
    return core.broker.attach_consumer("q", prefetch=10_000, max_batch=10_000)


async def _timeline(core: CoreBroker, consumer: Consumer, until_ms: int) -> list[tuple[int, str]]:
    """(ms since now, message id) of each delivery while the clock moves `until_ms`."""
    start = core.clock.now_ms()
    await core.settle()
    got = [(0, m) for m in core.take(consumer)]
    while core.clock.now_ms() - start < until_ms:
        await core.advance(STEP_MS)
        now = core.clock.now_ms() - start
        got += [(now, m) for m in core.take(consumer)]
    return got


def test_a_bucket_gives_its_burst_at_once_then_its_rate() -> None:
    """20/s with a burst of 5: 5 at once, then one every 50 ms: 105 in the first 5 s."""

    async def scenario() -> None:
        core = await _queue(("t", "20,5"))
        await _backlog(core, 200, "t")
        consumer = _consumer(core)
        got = await _timeline(core, consumer, 5000)
        times = [t for t, _ in got]
        assert times[:5] == [0] * 5
        # paced, not bunched: a token every 50 ms, taken within a millisecond of it
        gaps = {b - a for a, b in itertools.pairwise(times[4:])}
        assert gaps <= {49, 50, 51}, sorted(gaps)
        assert 103 <= len(got) <= 105

    run(scenario)


def test_a_throttled_key_does_not_hold_back_an_unthrottled_one() -> None:
    async def scenario() -> None:
        core = await _queue(("slow", "2,1"))
        slow = await _backlog(core, 30, "slow", fk="slowtenant")
        fast = await _backlog(core, 50, "", fk="fasttenant")
        consumer = _consumer(core)
        await core.settle()
        got = set(core.take(consumer))
        assert got == set(fast) | {slow[0]}  # all 50 at once, and the slow key's burst

    run(scenario)


def test_a_slow_keys_wake_up_does_not_delay_a_faster_key() -> None:
    async def scenario() -> None:
        core = await _queue(("crawl", "0.2,1"), ("quick", "20,1"))  # crawl: a token per 5 s
        crawler = await _backlog(core, 3, "crawl", fk="crawler")
        consumer = _consumer(core)
        await core.settle()
        assert core.take(consumer) == crawler[:1]  # the burst token; the next is 5 s away
        runner = await _backlog(core, 20, "quick", fk="runner")
        got = await _timeline(core, consumer, 1000)
        assert [m for _, m in got] == runner  # 1 at once, then one per 50 ms
        assert got[-1][0] <= 19 * 51

    run(scenario)


def test_raising_a_rate_takes_effect_at_once() -> None:
    async def scenario() -> None:
        core = await _queue(("c", "0.5,1"))  # a token every 2 s
        await _backlog(core, 80, "c")
        consumer = _consumer(core)
        assert len(await _timeline(core, consumer, 1500)) == 1
        await _set(core, "c", "50,1")
        got = await _timeline(core, consumer, 1000)
        assert got[0][0] <= 21, "the next token at the new rate, not the old one's 2 s"
        assert 48 <= len(got) <= 51

    run(scenario)


def test_lowering_a_rate_takes_effect_at_once() -> None:
    async def scenario() -> None:
        core = await _queue(("l", "50,1"))
        await _backlog(core, 100, "l")
        consumer = _consumer(core)
        assert len(await _timeline(core, consumer, 200)) >= 9  # burst 1 + about 10 at 50/s
        await _set(core, "l", "2,1")
        after = len(await _timeline(core, consumer, 2000))
        assert 3 <= after <= 5, f"{after} deliveries in 2 s after lowering to 2/s"

    run(scenario)


def test_removing_a_throttle_releases_its_backlog_at_once() -> None:
    async def scenario() -> None:
        core = await _queue(("r", "1,1"))
        ids = await _backlog(core, 60, "r")
        consumer = _consumer(core)
        await core.settle()
        assert core.take(consumer) == ids[:1]
        await _set(core, "r", "")  # no clock movement: released by the change itself
        assert core.take(consumer) == ids[1:]
        assert core.broker.stats("q").per_throttle == []

    run(scenario)


def test_a_message_with_two_throttle_keys_needs_a_token_of_each() -> None:
    async def scenario() -> None:
        core = await _queue(("a", "100,1"), ("b", "2,1"))
        # the slow key named first in one tenant, second in the other
        await _backlog(core, 15, "a,b", fk="ab")
        await _backlog(core, 15, "b,a", fk="ba")
        consumer = _consumer(core)
        got = await _timeline(core, consumer, 3000)
        # b's bucket (burst 1, 2/s) bounds the total: 1 + about 6 in 3 s; a's 100/s is moot
        assert 6 <= len(got) <= 7, [t for t, _ in got]

    run(scenario)


def test_a_bucket_starts_full_after_a_restart_and_keeps_its_rate() -> None:
    async def scenario() -> None:
        core = await _queue(("rs", "2,1"))
        await _backlog(core, 20, "rs")
        consumer = _consumer(core)
        assert 4 <= len(await _timeline(core, consumer, 2000)) <= 5  # burst 1 + ~4 at 2/s
        core.broker.close()
        core, _ = restarted(core)
        stats = {t.key: t for t in core.broker.stats("q").per_throttle}
        assert (stats["rs"].rate_per_second, stats["rs"].burst, stats["rs"].tokens) == (
            2.0,
            1.0,
            1.0,
        )
        consumer = _consumer(core)
        got = await _timeline(core, consumer, 2000)
        assert [t for t, _ in got][:1] == [0] and 4 <= len(got) <= 5

    run(scenario)


def test_retuning_a_bucket_keeps_its_tokens_capped_at_the_new_burst() -> None:
    """semantics.md: changing a bucket keeps its current tokens (capped at the new
    burst); only a new bucket starts full."""

    async def scenario() -> None:
        core = await _queue(("k", "0.001,10"))  # a token per 1,000 s: the burst is all
        ids = await _backlog(core, 30, "k")
        consumer = _consumer(core)
        await core.settle()
        assert core.take(consumer) == ids[:10]
        await _set(core, "k", "0.001,20")  # a bigger burst gives no tokens
        assert core.take(consumer) == []
        stats = {t.key: t for t in core.broker.stats("q").per_throttle}
        assert (stats["k"].burst, stats["k"].tokens < 1) == (20.0, True)

    run(scenario)
