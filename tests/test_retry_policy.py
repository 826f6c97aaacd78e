"""Retry policy, failure reasons, message states and queue updates, in process (memory
storage, manual clock, pinned jitter): the curve and its bounds, dead-lettering after
`max_attempts`, the hook's precedence, `last_error` through nack, DLQ and redrive,
peek states and the counts that add up to depth, and UpdateQueue's checks.
"""

from __future__ import annotations

import asyncio

import pytest
from support.core import CoreBroker, make_core, restarted

from fila.core import retry
from fila.core.administration import MessageState
from fila.core.errors import InvalidArgument
from fila.core.queue import QueueRecord
from fila.core.retry import Backoff
from fila.lua.hooks import FailureDecision
from fila.v1 import messages_pb2

RETRY_AT_ONCE = 'function on_failure(m) return { action = "retry" } end'
TO_DLQ = 'function on_failure(m) return { action = "dlq" } end'


def run(scenario: object) -> None:
    asyncio.run(scenario)  # type: ignore[arg-type]


def test_the_exponential_curve_stays_within_its_jitter_and_its_cap() -> None:
    curve = Backoff.parse("")
    assert str(curve) == "exponential"
    for attempt in range(1, 30):
        nominal = 1000 * 2 ** (attempt - 1)
        low = curve.delay_ms(attempt, lambda: 0.0)
        high = curve.delay_ms(attempt, lambda: 0.999999)
        assert low == min(int(nominal * 0.75), 3_600_000)
        assert high <= min(nominal * 1.25, 3_600_000) and high >= low
        assert curve.delay_ms(attempt, lambda: 0.5) == min(nominal, 3_600_000)
    assert curve.delay_ms(13, lambda: 0.0) == 3_072_000  # 0.75 * 4096 s
    assert curve.delay_ms(14, lambda: 0.0) == 3_600_000  # 0.75 * 8192 s is past the cap


def test_none_and_fixed_backoffs_and_refused_spellings() -> None:
    assert Backoff.parse("none").delay_ms(7, lambda: 0.9) == 0
    fixed = Backoff.parse("fixed:30s")
    assert (str(fixed), fixed.delay_ms(1, lambda: 0.0), fixed.delay_ms(9, lambda: 0.9)) == (
        "fixed:30s",
        30_000,
        30_000,
    )
    assert str(Backoff.parse("FIXED:1500")) == "fixed:1s500ms"
    assert Backoff.parse("fixed:1ms").fixed_ms == 1, "the shortest fixed wait"
    assert Backoff.parse("fixed:366d").fixed_ms == retry.MAX_FIXED_MS, "the longest"
    for bad in ("linear", "fixed:", "fixed:0s", "fixed:soon", "fixed:400d", "fixed:367d"):
        with pytest.raises(InvalidArgument, match="retry_backoff"):
            Backoff.parse(bad)
    with pytest.raises(InvalidArgument) as refused:
        Backoff.parse("linear")
    assert str(refused.value) == (
        'retry_backoff "linear" is not "exponential", "none" or "fixed:<duration>" '
        '(e.g. "fixed:30s")'
    )


def test_the_policy_retries_after_its_backoff_until_the_attempts_are_used_up() -> None:
    """What a queue without `on_failure` decides after a failed attempt: a retry after
    the backoff (at once for "none", or when the consumer's stream ended), and the DLQ
    once `max_attempts` failures are reached (0: never)."""
    half: retry.Random = lambda: 0.5  # noqa: E731 (no jitter)
    decide = retry.policy_decision
    assert decide(3, "fixed:5s", 2, half, wait=True) == FailureDecision("retry", 5000)
    assert decide(3, "exponential", 2, half, wait=True) == FailureDecision("retry", 2000)
    assert decide(3, "none", 2, half, wait=True) == FailureDecision("retry", 0)
    assert decide(3, "fixed:5s", 2, half, wait=False) == FailureDecision("retry", 0)
    assert decide(3, "fixed:5s", 3, half, wait=True) == FailureDecision("dlq")
    assert decide(3, "fixed:5s", 3, half, wait=False) == FailureDecision("dlq")
    assert decide(0, "fixed:5s", 10**6, half, wait=True) == FailureDecision("retry", 5000)


def test_max_attempts_on_the_wire_and_in_the_record() -> None:
    assert retry.stored_max_attempts(0) == 25
    assert retry.stored_max_attempts(retry.UNLIMITED) == 0
    assert retry.stored_max_attempts(3) == 3
    assert retry.wire_max_attempts(0) == retry.UNLIMITED
    # a record stored before retry policies: no limit, immediate retries, as before
    old = QueueRecord.decode(b'{"name":"old","visibility_timeout_ms":30000}')
    assert (old.max_attempts, old.retry_backoff) == (0, "none")


async def _stored(core: CoreBroker, message_id: str) -> messages_pb2.Message:
    await core.settle()
    core.committer.flush_now()
    raw = core.storage.get(b"m" + bytes.fromhex(message_id.replace("-", "")))
    assert raw is not None
    return messages_pb2.Message.FromString(raw)


def test_a_nacked_message_waits_on_the_curve_then_goes_to_the_dlq() -> None:
    async def scenario() -> None:
        core = make_core()  # jitter pinned at its middle: waits of exactly 1 s, 2 s, ...
        await core.broker.create_queue("jobs", "", "", 0, max_attempts=3)
        (message_id,) = await core.enqueue("jobs")
        consumer = core.broker.attach_consumer("jobs")
        for attempt, wait_ms in ((1, 1000), (2, 2000)):
            await core.settle()
            assert core.take(consumer) == [message_id]
            results, _ = core.broker.nack([("jobs", message_id, f"boom {attempt}")])
            assert results == [None]
            await core.advance(wait_ms - 1)
            assert core.take(consumer) == [], f"back before its {wait_ms} ms wait"
            stats = core.broker.stats("jobs")
            assert (stats.depth, stats.delayed) == (1, 1)
            await core.advance(1)
        assert core.take(consumer) == [message_id]
        core.broker.nack([("jobs", message_id, "boom 3")])  # the third failure: DLQ
        await core.settle()
        assert core.broker.stats("jobs").depth == 0
        assert core.broker.queues["jobs.dlq"].depth == 1
        stored = await _stored(core, message_id)
        meta = stored.metadata
        assert (meta.queue_id, meta.attempt_count, meta.last_error) == ("jobs.dlq", 3, "boom 3")
        now = core.clock.now_ms()
        assert meta.last_failed_at.ToMilliseconds() == meta.dead_lettered_at.ToMilliseconds()
        assert meta.dead_lettered_at.ToMilliseconds() == now

    run(scenario())


def test_the_jitter_draw_moves_the_wait_within_its_bounds() -> None:
    async def scenario() -> None:
        for draw, wait_ms in ((0.0, 750), (0.999, 1249)):
            core = make_core(random=lambda draw=draw: draw)
            await core.broker.create_queue("jobs", "", "", 0)
            (message_id,) = await core.enqueue("jobs")
            consumer = core.broker.attach_consumer("jobs")
            await core.settle()
            core.take(consumer)
            core.broker.nack([("jobs", message_id, "e")])
            await core.advance(wait_ms - 1)
            assert core.take(consumer) == []
            await core.advance(1)
            assert core.take(consumer) == [message_id]

    run(scenario())


def test_a_hook_decides_before_the_policy() -> None:
    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("hooked", "", RETRY_AT_ONCE, 0, max_attempts=1)
        await core.broker.create_queue("dead", "", TO_DLQ, 0, max_attempts=25)
        (retried,) = await core.enqueue("hooked")
        (dead,) = await core.enqueue("dead")
        hooked = core.broker.attach_consumer("hooked")
        dying = core.broker.attach_consumer("dead")
        await core.settle()
        for _ in range(3):  # past max_attempts=1, and at once: the hook said retry
            assert core.take(hooked) == [retried]
            core.broker.nack([("hooked", retried, "again")])
            await core.settle()
        assert core.take(dying) == [dead]
        core.broker.nack([("dead", dead, "bad")])  # first failure, DLQ: the hook said so
        await core.settle()
        assert core.broker.queues["dead.dlq"].depth == 1

    run(scenario())


def test_expiry_follows_the_policy_and_a_closed_stream_returns_at_once() -> None:
    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("jobs", "", "", 1000, max_attempts=2)
        (message_id,) = await core.enqueue("jobs")
        consumer = core.broker.attach_consumer("jobs")
        await core.settle()
        assert core.take(consumer) == [message_id]
        await core.advance(1000)  # the lease expires: attempt 1, a 1 s wait
        assert core.take(consumer) == []
        await core.advance(1000)
        assert core.take(consumer) == [message_id]
        stored = await _stored(core, message_id)
        assert stored.metadata.last_error == "visibility timeout expired"
        await core.advance(1000)  # attempt 2 of 2: dead-lettered
        assert core.broker.queues["jobs.dlq"].depth == 1

        # a StreamConsume stream that ends: its sent message is back at once, attempt 1
        await core.detach(consumer)
        (returned,) = await core.enqueue("jobs")
        stream = await core.attach("jobs", stream=True)
        assert core.take(stream) == [returned]
        await core.detach(stream)
        assert core.attempts("jobs") == {returned: 1}
        assert core.take(await core.attach("jobs")) == [returned], "no backoff wait"
        stored = await _stored(core, returned)
        assert stored.metadata.last_error == "consumer stream ended"

    run(scenario())


def test_last_error_is_clipped_and_kept_across_redrive() -> None:
    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("jobs", "", "", 0, max_attempts=1)
        (message_id,) = await core.enqueue("jobs")
        consumer = core.broker.attach_consumer("jobs")
        await core.settle()
        core.take(consumer)
        core.broker.nack([("jobs", message_id, "é" * 5000)])
        await core.settle()
        dead = await _stored(core, message_id)
        assert len(dead.metadata.last_error.encode()) <= 4096
        assert dead.metadata.last_error.endswith("[truncated, 10000 bytes in all]")
        count = await core.broker.redrive("jobs.dlq", 0)
        back = await _stored(core, message_id)
        assert (count, back.metadata.queue_id, back.metadata.attempt_count) == (1, "jobs", 0)
        assert back.metadata.last_error == dead.metadata.last_error
        assert back.metadata.dead_lettered_at == dead.metadata.dead_lettered_at

    run(scenario())


def test_peek_states_and_counts_add_up_to_depth() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        ready, leased = await core.enqueue("q", 2)
        (delayed,) = await core.enqueue("q", delay_ms=600_000)
        consumer = core.broker.attach_consumer("q", prefetch=1)
        await core.settle()
        assert core.take(consumer) == [ready]
        now = core.clock.now_ms()
        core.committer.flush_now()
        page, states, after = await core.broker.peek_states("q", 0, "", "")
        assert [m.id for m in page] == [ready, leased, delayed] and after == ""
        assert [(s.state, s.ready_at_ms, s.lease_deadline_ms) for s in states] == [
            (MessageState.LEASED, 0, now + 1000),
            (MessageState.READY, 0, 0),
            (MessageState.DELAYED, now + 600_000, 0),
        ]
        only = await core.broker.peek_states("q", 0, "", "", MessageState.DELAYED)
        assert [m.id for m in only[0]] == [delayed]
        leased_only = await core.broker.peek_states("q", 0, "", "", 3)
        assert [m.id for m in leased_only[0]] == [ready]
        stats = core.broker.stats("q")
        ready_count = sum(k.pending for k in stats.per_key)
        assert (stats.depth, stats.delayed, stats.in_flight, ready_count) == (2, 1, 1, 1)
        assert stats.depth == ready_count + stats.delayed
        with pytest.raises(InvalidArgument, match="not a message state"):
            await core.broker.peek_states("q", 0, "", "", 7)

    run(scenario())


def test_update_queue_checks_everything_before_it_changes_anything() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        admin = core.broker
        before = core.broker.queues["q"].record
        bad = [
            ({"on_enqueue_script": "function on_enqueue(m) os.execute() end"}, "os.execute"),
            ({"on_failure_script": "function nope() end"}, "does not define"),
            ({"retry_backoff": "linear"}, "retry_backoff"),
            ({"visibility_timeout_ms": 8 * 24 * 3600 * 1000}, "over the limit"),
            ({"name": "x"}, "cannot update"),
            ({}, "nothing to update"),
            ({"max_attempts": 3, "retry_backoff": "sometimes"}, "retry_backoff"),
        ]
        for changes, words in bad:
            with pytest.raises(InvalidArgument, match=words):
                admin.update_queue("q", changes)
            assert core.broker.queues["q"].record == before
        with pytest.raises(InvalidArgument, match="dead-letter queue"):
            admin.update_queue("q.dlq", {"max_attempts": 3})
        record, committed = admin.update_queue(
            "q", {"max_attempts": 4, "retry_backoff": "fixed:30s", "visibility_timeout_ms": 0}
        )
        await committed
        assert (record.max_attempts, record.retry_backoff, record.visibility_timeout_ms) == (
            4,
            "fixed:30s",
            30_000,
        )
        restarted_core, _ = restarted(core)
        assert restarted_core.broker.queues["q"].record == record  # stored

    run(scenario())


def test_an_update_applies_to_messages_enqueued_after_it() -> None:
    keyed = 'function on_enqueue(m) return { fairness_key = "%s" } end'

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", keyed % "before", "", 0)
        (first,) = await core.enqueue("q")
        _, committed = core.broker.update_queue("q", {"on_enqueue_script": keyed % "after"})
        (second,) = await core.enqueue("q")
        await committed
        page, _ = await core.broker.peek("q", 0, "", "")
        assert [(m.id, m.metadata.fairness_key) for m in page] == [
            (first, "before"),
            (second, "after"),
        ]

    run(scenario())


def test_hook_errors_are_counted_with_the_last_text_and_time() -> None:
    failing = (
        'function on_enqueue(m) if m.headers.bad then error("no " .. m.headers.bad) end '
        "return {} end"
    )

    async def scenario() -> None:
        core = make_core()
        await core.broker.create_queue("q", failing, "", 0)
        await core.enqueue("q", headers={"bad": "tenant"})
        await core.advance(5000)
        await core.enqueue("q")
        await core.enqueue("q", headers={"bad": "key"})
        stats = core.broker.stats("q")
        assert stats.hook_errors_total == 2
        assert stats.last_hook_error.endswith("no key")
        assert stats.last_hook_error_at_ms == core.clock.now_ms()

    run(scenario())
