"""Rules docs/semantics.md states that no other test would notice being broken.

Each test drives the real broker in-process (`support.core`: in-memory storage, a
manual clock) through the calls the gRPC edge makes, and checks the documented rule
from the outside: where a message is, its attempt count, when it comes back. Each was
seen to fail with the rule broken (docs/testing.md lists the breaks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from support.core import CoreBroker, make_core, restarted

from fila.config import parse_config
from fila.core.errors import MessageNotFound, ResourceExhausted
from fila.core.ids import parse_id
from fila.storage import keys
from fila.v1 import service_pb2

DEAD_LETTER = 'function on_failure(m) return { action = "dlq" } end'


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def _depth(core: CoreBroker, queue: str) -> tuple[int, int]:
    """(depth, in_flight), as GetStats reports them."""
    stats = core.broker.stats(queue)
    return stats.depth, stats.in_flight


async def _attempts(core: CoreBroker, queue: str) -> dict[str, int]:
    """Every message of `queue` (ready, delayed or leased) and its attempt count."""
    page, _ = await core.broker.peek(queue, 1000, "", "")
    return {m.id: m.metadata.attempt_count for m in page}


async def _dead_lettering_queue(core: CoreBroker, *, visibility_timeout_ms: int = 0) -> None:
    await core.broker.create_queue("q", "", DEAD_LETTER, visibility_timeout_ms)


async def _nack(core: CoreBroker, queue: str, *message_ids: str) -> None:
    results, committed = core.broker.nack([(queue, m, "failed") for m in message_ids])
    assert results == [None] * len(message_ids)
    await committed
    await core.settle()


# -- leases that end without a nack --------------------------------------------------------


def test_an_expired_lease_counts_an_attempt_but_does_not_run_on_failure() -> None:
    """semantics.md, Consumers and leases: expiry is a failed attempt, but a consumer
    that vanished must not push messages into the DLQ by timing out."""

    async def scenario() -> None:
        core = make_core()
        await _dead_lettering_queue(core, visibility_timeout_ms=1000)
        (message_id,) = await core.enqueue("q")
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        assert core.take(consumer) == [message_id]
        await core.advance(1001)
        assert await _attempts(core, "q") == {message_id: 1}
        assert _depth(core, "q.dlq") == (0, 0)
        assert core.take(consumer) == [message_id], "ready again in its own queue"

    run(scenario)


def test_a_stream_consume_stream_that_ends_returns_what_it_was_sent_without_on_failure() -> None:
    """semantics.md, Batch paths: a StreamConsume stream's end returns its sent,
    unsettled messages as a failed attempt, like an expired lease, without running
    on_failure; messages it was never sent come back with no attempt."""

    async def scenario() -> None:
        core = make_core()
        await _dead_lettering_queue(core)
        first, second, unsent = await core.enqueue("q", 3)
        consumer = core.broker.attach_consumer("q", prefetch=3, max_batch=2, owns_settlement=True)
        await core.settle()
        assert core.broker.sending(consumer, 2) is not None  # two of three leave
        core.broker.detach_consumer(consumer)
        await core.settle()
        assert await _attempts(core, "q") == {first: 1, second: 1, unsent: 0}
        assert _depth(core, "q") == (3, 0)
        assert _depth(core, "q.dlq") == (0, 0)
        assert core.broker.stats("q").counters.expired == 2  # counted as expiries

    run(scenario)


def test_stream_consume_settles_what_it_was_sent_and_refuses_anything_else() -> None:
    """Batch paths, StreamConsume: acks and nacks on the stream apply in order (the acks,
    then the nacks) and reach storage with the next commit; an id the stream does not
    hold (never sent on it, leased on another stream, already settled) is NOT_FOUND."""

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", "", "", 0, retry_backoff="none")
        acked, nacked, other, unsent = await core.enqueue("q", 4)
        stream = core.broker.attach_consumer("q", prefetch=2, max_batch=2, owns_settlement=True)
        await core.settle()
        assert core.take(stream) == [acked, nacked]
        elsewhere = core.broker.attach_consumer("q", prefetch=1)
        await core.settle()
        assert core.take(elsewhere) == [other]
        core.broker.settle_on_stream(stream.id, "q", [acked], [(nacked, "bad")])
        await core.settle()
        assert core.storage.get(keys.MESSAGE + parse_id(acked)) is None  # acked: gone
        assert (await _attempts(core, "q"))[nacked] == 1
        counters = core.broker.stats("q").counters
        assert (counters.acked, counters.nacked) == (1, 1)
        for foreign in (other, acked, "not-an-id"):
            with pytest.raises(MessageNotFound):
                core.broker.settle_on_stream(stream.id, "q", [foreign], [])
            with pytest.raises(MessageNotFound):
                core.broker.settle_on_stream(stream.id, "q", [], [(foreign, "x")])
        assert (await _attempts(core, "q"))[other] == 0, "another stream's lease is untouched"
        assert unsent in await _attempts(core, "q")

    run(scenario)


def test_extend_lease_may_shorten_a_deadline_and_the_message_comes_back_then() -> None:
    """semantics.md: ExtendLease sets the deadline to now + extend_ms, shorter or not."""

    async def scenario() -> None:
        core = make_core()
        # retries at once (no backoff), so the message is back at the deadline itself
        await core.broker.create_queue("q", "", "", 30_000, retry_backoff="none")
        (message_id,) = await core.enqueue("q")
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        assert core.take(consumer) == [message_id]
        await core.advance(1000)
        deadline, committed = core.broker.extend_lease("q", message_id, 500)
        await committed
        assert deadline == core.clock.now_ms() + 500
        await core.advance(499)
        assert core.take(consumer) == []
        await core.advance(2)
        assert core.take(consumer) == [message_id], "back at the shortened deadline"
        assert await _attempts(core, "q") == {message_id: 1}

    run(scenario)


def test_an_expiry_returns_every_lease_of_its_millisecond_sent_or_not() -> None:
    """Leases granted in one millisecond expire together: one never sent comes back
    with no attempt, one sent comes back as a failed attempt, whatever their order."""

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", "", "", 1000, retry_backoff="none")
        core.broker.attach_consumer("q", prefetch=1)  # a stream that never sends
        busy = core.broker.attach_consumer("q", prefetch=1)
        unsent, sent = await core.enqueue("q", 2)  # one each, round-robin: idle first
        assert core.take(busy) == [sent]
        core.broker.detach_consumer(busy)
        await core.advance(1001)
        assert await _attempts(core, "q") == {unsent: 0, sent: 1}
        assert core.broker.stats("q").counters.expired == 1

    run(scenario)


def test_a_retried_message_goes_back_to_the_front_of_its_key() -> None:
    """semantics.md, Delivery order: a message nacked for immediate retry or whose
    lease expired goes back to the front of its key, before newer messages."""

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", "", "", 1000, retry_backoff="none")
        ids = await core.enqueue("q", 3)
        consumer = core.broker.attach_consumer("q", prefetch=1)
        await core.settle()
        assert core.take(consumer) == ids[:1]
        await _nack(core, "q", ids[0])
        assert core.take(consumer) == ids[:1], "nacked: first again"
        await core.advance(1001)
        assert core.take(consumer) == ids[:1], "expired: first again"

    run(scenario)


def test_a_retry_does_not_change_its_keys_weight() -> None:
    """semantics.md: a key's weight is the weight of its most recently *enqueued*
    message; a retried older message does not take it back."""

    async def scenario() -> None:
        core = make_core()
        weighted = (
            "function on_enqueue(m) "
            'return { fairness_key = "k", weight = tonumber(m.headers.w) } end'
        )
        await core.broker.create_queue("q", weighted, "", 1000, retry_backoff="none")
        (light,) = await core.enqueue("q", headers={"w": "1"})
        consumer = core.broker.attach_consumer("q", prefetch=1)
        await core.settle()  # `light` is leased into the stream's buffer, not sent
        await core.enqueue("q", headers={"w": "5"})

        def weight() -> int:
            (key,) = core.broker.stats("q").per_key
            return key.weight

        assert weight() == 5
        core.broker.detach_consumer(consumer)
        await core.settle()
        assert weight() == 5, "after a return unsent"
        await core.enqueue("q", headers={"w": "1"})  # the newest: the key's weight is 1
        consumer = core.broker.attach_consumer("q", prefetch=1)
        await core.settle()
        assert core.take(consumer) == [light]
        await core.enqueue("q", headers={"w": "5"})
        await _nack(core, "q", light)
        assert weight() == 5, "after a nack"

    run(scenario)


def test_dead_letters_keep_id_order_in_the_dlq_whatever_order_they_failed_in() -> None:
    """semantics.md: redrive moves DLQ messages oldest first within each key; a
    message dead-lettered later but enqueued earlier comes first."""

    async def scenario() -> None:
        core = make_core()
        await _dead_lettering_queue(core)
        older, newer = await core.enqueue("q", 2)
        consumer = core.broker.attach_consumer("q", prefetch=2)
        await core.settle()
        assert core.take(consumer) == [older, newer]
        await _nack(core, "q", newer)
        await _nack(core, "q", older)
        dead = core.broker.attach_consumer("q.dlq", prefetch=2)
        await core.settle()
        assert core.take(dead) == [older, newer]

    run(scenario)


def test_on_failure_sees_the_attempts_including_this_failure() -> None:
    """semantics.md: `on_failure` sees `msg.attempts` including the current failure
    (1 on the first nack)."""

    async def scenario() -> None:
        core = make_core()
        script = (
            "function on_failure(m) if m.attempts >= 2 then "
            'return { action = "dlq" } end return { action = "retry" } end'
        )
        await core.broker.create_queue("q", "", script, 0)
        (message_id,) = await core.enqueue("q")
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        core.take(consumer)
        await _nack(core, "q", message_id)
        assert await _attempts(core, "q") == {message_id: 1}, "retried on the first failure"
        assert core.take(consumer) == [message_id]
        await _nack(core, "q", message_id)
        assert await _attempts(core, "q.dlq") == {message_id: 2}, "dead-lettered on the second"

    run(scenario)


def test_a_hook_retry_delay_is_waited_in_full_on_the_clock() -> None:
    """`{action="retry", delay_ms=N}` makes the message ready again after N ms."""

    async def scenario() -> None:
        core = make_core()
        script = (
            "function on_failure(m) "
            'return { action = "retry", delay_ms = tonumber(m.headers.d) } end'
        )
        await core.broker.create_queue("q", "", script, 0)
        consumer = core.broker.attach_consumer("q")
        for delay in (2000, 1):
            (message_id,) = await core.enqueue("q", headers={"d": str(delay)})
            assert core.take(consumer) == [message_id]
            await _nack(core, "q", message_id)
            await core.advance(delay - 1) if delay > 1 else await core.settle()
            assert core.take(consumer) == [], f"back before its {delay} ms"
            await core.advance(1)
            assert core.take(consumer) == [message_id]
            _, committed = core.broker.ack([("q", message_id)])
            await committed

    run(scenario)


def test_an_extended_lease_outlives_its_old_deadline_and_leaves_its_neighbours_alone() -> None:
    """ExtendLease moves a lease's deadline: it does not expire at the old one, and a
    lease granted in the same millisecond still expires at that one."""

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", "", "", 1000, retry_backoff="none")
        kept, other = await core.enqueue("q", 2)
        consumer = core.broker.attach_consumer("q", prefetch=2, max_batch=2)
        await core.settle()
        assert core.take(consumer) == [kept, other]  # one millisecond, one deadline
        deadline, committed = core.broker.extend_lease("q", kept, 5000)
        await committed
        await core.advance(1001)
        assert await _attempts(core, "q") == {kept: 0, other: 1}
        await core.advance(deadline - core.clock.now_ms() - 1)
        assert (await _attempts(core, "q"))[kept] == 0
        await core.advance(1)
        assert (await _attempts(core, "q"))[kept] == 1

    run(scenario)


def test_an_extension_is_stored_and_survives_a_restart() -> None:
    """semantics.md: ExtendLease is durable before the answer; after a restart the
    lease comes back with the extended deadline."""

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", "", "", 1000, retry_backoff="none")
        (message_id,) = await core.enqueue("q")
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        assert core.take(consumer) == [message_id]
        _, committed = core.broker.extend_lease("q", message_id, 60_000)
        await committed
        core.broker.close()
        core, _ = restarted(core)
        await core.advance(59_999)
        assert _depth(core, "q") == (0, 1), "still leased until the extended deadline"
        await core.advance(1)
        assert _depth(core, "q") == (1, 0)

    run(scenario)


def test_a_batch_nack_applies_each_item_on_its_own_and_counts_it() -> None:
    """Batch paths: an item that fails gets its error and the others are applied."""

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", "", "", 0, retry_backoff="none")
        (message_id,) = await core.enqueue("q")
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        core.take(consumer)
        results, committed = core.broker.nack(
            [("q", "not-an-id", "x"), ("nope", message_id, "x"), ("q", message_id, "x")]
        )
        await committed
        assert [type(r).__name__ for r in results] == [
            "MessageNotFound",
            "QueueNotFound",
            "NoneType",
        ]
        assert await _attempts(core, "q") == {message_id: 1}
        assert core.broker.stats("q").counters.nacked == 1

    run(scenario)


def test_a_delayed_message_purged_before_it_is_due_stays_gone() -> None:
    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", "", "", 0)
        await core.enqueue("q", delay_ms=1000)
        consumer = core.broker.attach_consumer("q")
        count, committed = core.broker.purge("q")
        await committed
        assert count == 1
        await core.advance(1000)  # its timer fires with nothing to release
        assert core.take(consumer) == []
        assert _depth(core, "q") == (0, 0)

    run(scenario)


# -- dead-letter queues ----------------------------------------------------------------------


def test_a_nack_in_a_dlq_retries_at_once_in_the_dlq() -> None:
    """semantics.md, Queues: a DLQ has no hooks and no DLQ of its own; a nack there
    makes the message ready again at once, in the DLQ."""

    async def scenario() -> None:
        core = make_core()
        await _dead_lettering_queue(core)
        (message_id,) = await core.enqueue("q")
        consumer = core.broker.attach_consumer("q")
        await core.settle()
        core.take(consumer)
        await _nack(core, "q", message_id)
        assert await _attempts(core, "q.dlq") == {message_id: 1}
        dead = core.broker.attach_consumer("q.dlq")
        await core.settle()
        assert core.take(dead) == [message_id]
        await _nack(core, "q.dlq", message_id)
        assert core.take(dead) == [message_id], "ready again at once, with no delay"
        assert await _attempts(core, "q.dlq") == {message_id: 2}
        assert _depth(core, "q") == (0, 0)

    run(scenario)


def test_redrive_moves_count_oldest_first_resets_attempts_and_reruns_on_enqueue() -> None:
    """semantics.md, Failures and dead letters: Redrive moves ready DLQ messages back,
    oldest first, `count` of them (0: all), with `attempt_count` 0, through the source
    queue's `on_enqueue` again."""

    async def scenario() -> None:
        core = make_core()
        keyed = 'function on_enqueue(m) return { fairness_key = m.headers.k or "none" } end'
        await core.broker.create_queue("q", keyed, DEAD_LETTER, 0)
        ids = await core.enqueue("q", 3, headers={"k": "tenant"})
        consumer = core.broker.attach_consumer("q", prefetch=3)
        await core.settle()
        assert core.take(consumer) == ids
        await _nack(core, "q", *ids)
        core.broker.detach_consumer(consumer)
        assert await core.broker.redrive("q.dlq", 2) == 2
        await core.settle()
        page, _ = await core.broker.peek("q", 10, "", "")
        assert [(m.id, m.metadata.attempt_count) for m in page] == [(ids[0], 0), (ids[1], 0)]
        assert {m.metadata.fairness_key for m in page} == {"tenant"}
        assert {m.metadata.queue_id for m in page} == {"q"}
        assert await _attempts(core, "q.dlq") == {ids[2]: 1}
        assert core.broker.stats("q").counters.redriven == 2

    run(scenario)


def test_peek_filters_by_key_pages_across_states_and_marks_leases() -> None:
    """semantics.md: PeekMessages lists ready, delayed and leased messages in id order;
    leased ones carry `leased_at`; `fairness_key` filters; pages go on after_id."""

    async def scenario() -> None:
        core = make_core()
        keyed = "function on_enqueue(m) return { fairness_key = m.headers.k } end"
        await core.broker.create_queue("q", keyed, "", 0)
        leased = (await core.enqueue("q", headers={"k": "a"}))[0]
        consumer = core.broker.attach_consumer("q", prefetch=1)
        await core.settle()
        assert core.take(consumer) == [leased]
        delayed = (await core.enqueue("q", headers={"k": "a"}, delay_ms=60_000))[0]
        other = (await core.enqueue("q", headers={"k": "b"}))[0]
        ready = (await core.enqueue("q", headers={"k": "a"}))[0]
        first, after = await core.broker.peek("q", 2, "", "a")
        assert [m.id for m in first] == [leased, delayed] and after == delayed
        assert first[0].timestamps.HasField("leased_at")
        assert not first[1].timestamps.HasField("leased_at")
        rest, end = await core.broker.peek("q", 2, after, "a")
        assert ([m.id for m in rest], end) == ([ready], "")
        everything, _ = await core.broker.peek("q", 10, "", "")
        assert [m.id for m in everything] == [leased, delayed, other, ready]

    run(scenario)


def _bounded(depth: int) -> CoreBroker:
    return make_core(config=parse_config(f"[server]\nmax_queue_depth = {depth}\n", "test"))


async def _refused(core: CoreBroker, queue: str) -> bool:
    results, committed = core.broker.enqueue([service_pb2.EnqueueRequest(queue=queue)])
    await committed
    return isinstance(results[0], ResourceExhausted)


def test_max_queue_depth_never_refuses_dead_lettering() -> None:
    """semantics.md, Limits: dead-lettering moves a message already stored, so a DLQ
    at `server.max_queue_depth` still takes it."""

    async def scenario() -> None:
        core = _bounded(2)
        await _dead_lettering_queue(core)
        failed: list[str] = []
        for _ in range(2):  # two rounds of two: the DLQ is full after the first
            ids = await core.enqueue("q", 2)
            assert await _refused(core, "q"), "the limit is in force"
            consumer = core.broker.attach_consumer("q", prefetch=10)
            await core.settle()
            assert core.take(consumer) == ids
            await _nack(core, "q", *ids)
            core.broker.detach_consumer(consumer)
            failed += ids
        assert _depth(core, "q.dlq") == (4, 0)
        assert set(await _attempts(core, "q.dlq")) == set(failed)

    run(scenario)


def test_max_queue_depth_never_refuses_redrive() -> None:
    """semantics.md, Limits: redrive moves messages already stored, so it moves them
    into a queue at `server.max_queue_depth`."""

    async def scenario() -> None:
        core = _bounded(2)
        await _dead_lettering_queue(core)
        dead = await core.enqueue("q", 2)
        consumer = core.broker.attach_consumer("q", prefetch=10)
        await core.settle()
        assert core.take(consumer) == dead
        await _nack(core, "q", *dead)
        core.broker.detach_consumer(consumer)
        full = await core.enqueue("q", 2)
        assert await _refused(core, "q"), "the queue is full"
        moved = await core.broker.redrive("q.dlq", 0)
        await core.settle()
        assert moved == 2
        assert _depth(core, "q") == (4, 0)
        assert set(await _attempts(core, "q")) == set(full + dead)

    run(scenario)


# -- consumers and peek ----------------------------------------------------------------------


def test_prefetch_is_capped_by_max_prefetch() -> None:
    """api.md / semantics.md, Batch paths: a stream's prefetch is capped by
    `scheduler.max_prefetch`."""

    async def scenario() -> None:
        core = make_core(config=parse_config("[scheduler]\nmax_prefetch = 5\n", "test"))
        await core.broker.create_queue("q", "", "", 0)
        ids = await core.enqueue("q", 12)
        consumer = core.broker.attach_consumer("q", prefetch=100, max_batch=100)
        await core.settle()
        assert core.take(consumer) == ids[:5]
        assert core.take(consumer) == []
        assert _depth(core, "q") == (7, 5)

    run(scenario)


def test_a_peek_limit_over_1000_is_treated_as_1000() -> None:
    """semantics.md: `limit` over 1,000 is treated as 1,000 (not refused), and
    `next_after_id` says there is more."""

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", "", "", 0)
        ids = await core.enqueue("q", 1001)
        page, after = await core.broker.peek("q", 100_000, "", "")
        assert [m.id for m in page] == ids[:1000]
        assert after == ids[999]
        rest, end = await core.broker.peek("q", 100_000, after, "")
        assert ([m.id for m in rest], end) == (ids[1000:], "")

    run(scenario)


def test_a_peek_page_stops_at_about_3_mib() -> None:
    """semantics.md: a page stops early at about 3 MiB of messages, so an answer fits
    a default client's 4 MiB; paging goes on from where it stopped."""

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", "", "", 0)
        requests = [
            service_pb2.EnqueueRequest(queue="q", payload=bytes(700 * 1024)) for _ in range(10)
        ]
        results, committed = core.broker.enqueue(requests)
        await committed
        await core.settle()
        ids = [str(r) for r in results]
        seen: list[str] = []
        after = ""
        pages = 0
        while True:
            page, after = await core.broker.peek("q", 1000, after, "")
            pages += 1
            # 4 x 700 KiB fit under 3 MiB, a fifth would not: "about 3 MiB", both ways
            assert len(page) == min(4, 10 - len(seen))
            assert sum(m.ByteSize() for m in page) <= 3 * 1024 * 1024
            seen += [m.id for m in page]
            if not after:
                break
            assert after == page[-1].id
        assert (seen, pages) == (ids, 3)

    run(scenario)
