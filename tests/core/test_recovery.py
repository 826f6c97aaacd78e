"""Recovery: a restart over the same storage rebuilds what the broker had committed.

SPEC 2, Durability and recovery: queues, messages, leases with their deadlines,
runtime config and the DRR state come back; expired leases are redelivered with one
more attempt; nothing is duplicated and nothing acked comes back. `restarted` is a
crash after the last commit: the new broker has only what storage holds (no
consumers, buckets full). Real RocksDB, fsync and kill -9 are tests/test_recovery.py's.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest
from support.core import CoreBroker, config, make_core, restarted, run_async

from fila.core.errors import ConfigKeyNotFound, MessageNotFound
from fila.core.key_order import SORTED_FROM
from fila.storage import keys

HOUR_MS = 3_600_000

# key from a header, weight from a header, else from runtime config (`fila.get`)
TENANT = """
function on_enqueue(m)
  local w = m.headers.w or fila.get("app.default_weight") or "1"
  return { fairness_key = m.headers.tenant or "default", weight = tonumber(w) }
end
"""
BY_FATE = """
function on_failure(m)
  if m.headers.fate == "dlq" then return { action = "dlq" } end
  if m.headers.fate == "later" then return { action = "retry", delay_ms = 60000 } end
  return { action = "retry" }
end
"""


async def _leased(core: CoreBroker, queue: str, count: int = 1) -> list[str]:
    """Enqueues `count` messages and delivers them to a consumer that then goes away
    (received, so they stay leased until their deadline)."""
    ids = await core.enqueue(queue, count)
    consumer = await core.attach(queue, prefetch=count, max_batch=count)
    assert core.take(consumer) == ids
    await core.detach(consumer)
    return ids


async def _delivered(core: CoreBroker, queue: str, count: int) -> list[str]:
    consumer = await core.attach(queue, prefetch=count, max_batch=count)
    got = core.take(consumer)
    await core.detach(consumer)
    return got


# -- queues, config, hooks --------------------------------------------------------------------


@run_async
async def test_a_restart_brings_back_the_queues_with_their_hooks_and_timeouts() -> None:
    core = make_core()
    await core.create_queue("orders", on_enqueue=TENANT, visibility_timeout_ms=2000)
    await core.create_queue("plain")
    await core.set_config("app.default_weight", "4")
    names = core.queue_names()
    core, report = restarted(core)
    await core.settle()
    assert core.queue_names() == names == ["orders", "orders.dlq", "plain", "plain.dlq"]
    assert report.queues == 4
    await core.enqueue_each("orders", [{"tenant": "z"}])  # the hook runs, reading config
    assert [(k.key, k.weight) for k in core.stats("orders").per_key] == [("z", 4)]
    assert list(core.lease_deadlines("orders").values()) == []
    consumer = await core.attach("orders")
    core.take(consumer)
    assert list(core.lease_deadlines("orders").values()) == [core.now_ms() + 2000]


@run_async
async def test_a_restart_brings_back_runtime_config_and_full_throttle_buckets() -> None:
    core = make_core()
    await core.set_config("app.other", "x")
    await core.set_config("app.gone", "soon")
    await core.set_config("app.gone", "")  # deleted: it stays deleted
    await core.set_config("throttle.slow", "5,10")
    await core.create_queue(
        "q", on_enqueue='function on_enqueue(m) return { throttle_keys = { "slow" } } end'
    )
    await core.enqueue("q", 20)
    consumer = await core.attach("q", prefetch=20, max_batch=20)
    assert len(core.take(consumer)) == 10, "the burst"
    assert [(t.key, t.tokens) for t in core.stats("q").per_throttle] == [("slow", 0.0)]
    core, _ = restarted(core)
    await core.settle()
    assert core.get_config("app.other") == "x"
    with pytest.raises(ConfigKeyNotFound):
        core.get_config("app.gone")
    (bucket,) = core.stats("q").per_throttle
    assert (bucket.key, bucket.tokens, bucket.rate_per_second, bucket.burst) == (
        "slow",
        10.0,
        5.0,
        10.0,
    )
    consumer = await core.attach("q", prefetch=20, max_batch=20)
    assert len(core.take(consumer)) == 10, "the restored bucket throttles"


# -- ready messages and the DRR ---------------------------------------------------------------


@run_async
async def test_a_restart_rebuilds_each_keys_fifo_order_and_the_drr_weights() -> None:
    core = make_core()
    await core.create_queue("orders", on_enqueue=TENANT)
    # tenant a changes weight on its last message: the rebuilt ring takes the weight
    # of each key's most recent message
    plan = [
        (tenant, weight)
        for i in range(6)
        for tenant, weight in (("a", 2 if i == 5 else 1), ("b", 2), ("c", 3))
        if not (tenant == "c" and i >= 4)
    ]
    sent: dict[str, list[str]] = defaultdict(list)
    for tenant, weight in plan:
        (message_id,) = await core.enqueue_each("orders", [{"tenant": tenant, "w": str(weight)}])
        sent[tenant].append(message_id)
    before = [(k.key, k.pending, k.weight) for k in core.stats("orders").per_key]
    assert before == [("a", 6, 2), ("b", 6, 2), ("c", 4, 3)]
    core, report = restarted(core)
    await core.settle()
    assert report.ready == len(plan)
    assert [(k.key, k.pending, k.weight, k.deficit) for k in core.stats("orders").per_key] == [
        (key, pending, weight, 0) for key, pending, weight in before
    ]
    consumer = await core.attach("orders", prefetch=100, max_batch=100)
    got = core.receive(consumer)
    by_key: dict[str, list[str]] = defaultdict(list)
    for message in got:
        assert message.metadata.attempt_count == 0
        by_key[message.metadata.fairness_key].append(message.id)
    assert by_key == sent
    assert Counter(m.metadata.fairness_key for m in got[:7]) == {"a": 2, "b": 2, "c": 3}


@run_async
async def test_ids_after_a_restart_sort_after_every_earlier_id_in_the_same_millisecond() -> None:
    """5,000 ids in one millisecond overflow its counter into the next one; a restart
    on the same clock must not hand out ids that sort before them."""
    core = make_core(queues=["q"])
    burst = await core.enqueue("q", 5000)
    core, _ = restarted(core)
    await core.settle()
    (late,) = await core.enqueue("q")
    assert late > max(burst)
    core, _ = restarted(core)
    await core.settle()
    consumer = await core.attach("q", prefetch=6000, max_batch=6000)
    assert core.take(consumer) == [*burst, late]


@run_async
async def test_dead_letters_and_redriven_messages_keep_their_order_across_a_restart() -> None:
    core = make_core()
    for queue in ("dead", "back"):
        await core.create_queue(queue, on_failure=BY_FATE)
    dead = await core.enqueue_each("dead", [{"fate": "dlq"}] * 3)
    back = await core.enqueue_each("back", [{"fate": "dlq"}] * 2)
    for queue, ids in (("dead", dead), ("back", back)):
        consumer = await core.attach(queue, prefetch=10, max_batch=10)
        assert core.take(consumer) == ids
        for message_id in reversed(ids):  # failed newest first
            await core.nack(queue, message_id)
    newer = await core.enqueue("back")
    assert await core.redrive("back.dlq") == 2
    core, _ = restarted(core)
    await core.settle()
    assert await _delivered(core, "dead.dlq", 10) == dead
    assert await _delivered(core, "back", 10) == back + newer


# -- leases -----------------------------------------------------------------------------------


@run_async
async def test_a_lease_comes_back_leased_until_its_deadline_and_then_expires() -> None:
    core = make_core()
    await core.create_queue("q", visibility_timeout_ms=4000)
    (message_id,) = await _leased(core, "q")
    (ready,) = await core.enqueue("q")
    deadline = core.now_ms() + 4000
    await core.advance(1000)
    core, report = restarted(core)
    await core.settle()
    assert (report.leased, report.ready) == (1, 1)
    assert core.lease_deadlines("q") == {message_id: deadline}, "not reset by the restart"
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    assert core.take(consumer) == [ready]
    await core.advance(2999)
    assert core.take(consumer) == []
    await core.advance(1)
    (again,) = core.receive(consumer)
    assert (again.id, again.metadata.attempt_count) == (message_id, 1)


@run_async
async def test_thousands_of_leases_come_back_leased_and_peek_lists_them_in_id_order() -> None:
    """Past `SORTED_FROM` leases a queue keeps them in id order as they are restored,
    for peek, instead of sorting them on each call."""
    count = SORTED_FROM + 10
    core = make_core(config=config(f"[scheduler]\nmax_prefetch = {count}\n"), queues=["q"])
    ids = await core.enqueue("q", count)
    consumer = await core.attach("q", prefetch=count, max_batch=count)
    assert len(core.take(consumer)) == count
    after, _ = restarted(core)
    await after.settle()
    assert after.depth("q") == (0, count)
    first, _ = after.peek("q")
    later, _ = after.peek("q", after_id=ids[-6])
    assert [m.id for m in first] == ids[:1000] and [m.id for m in later] == ids[-5:]


@run_async
async def test_a_restored_lease_can_be_acked_and_then_stays_gone() -> None:
    core = make_core(queues=["q"])
    (message_id,) = await _leased(core, "q")
    core, _ = restarted(core)
    await core.settle()
    assert await core.ack("q", message_id) == [None]
    assert isinstance((await core.ack("q", message_id))[0], MessageNotFound)
    core, report = restarted(core)
    await core.settle()
    assert (report.leased, report.ready, report.expired) == (0, 0, 0)
    assert core.stored(keys.MESSAGE) == [] and core.stored(keys.LEASE) == []


@run_async
async def test_a_lease_whose_deadline_passed_while_down_is_ready_with_one_more_attempt() -> None:
    core = make_core(queues=["q"])  # visibility timeout 1000 ms
    (message_id,) = await _leased(core, "q")
    core.clock.advance(1500)  # the broker is down meanwhile
    core, report = restarted(core)
    await core.settle()
    assert (report.expired, report.leased) == (1, 0)
    assert core.depth("q") == (1, 0)
    assert core.attempts("q") == {message_id: 1}
    assert core.stored(keys.LEASE) == []
    (again,) = core.receive(await core.attach("q"))
    assert (again.id, again.metadata.attempt_count) == (message_id, 1)


@run_async
async def test_a_message_buffered_for_a_stream_but_never_sent_is_ready_with_no_attempt() -> None:
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 4)
    consumer = await core.attach("q", prefetch=4, max_batch=1)
    assert core.unsettled(consumer) == 4, "all four leased into the stream's buffer"
    assert core.sending(consumer) is not None  # one frame handed to gRPC: sent
    core, report = restarted(core)  # a crash: the stream and its buffer are gone
    await core.settle()
    assert (report.leased, report.ready) == (1, 3)
    assert list(core.lease_deadlines("q")) == ids[:1]
    assert core.attempts("q") == dict.fromkeys(ids, 0)


# -- delays, dead letters, deletes -------------------------------------------------------------


@run_async
async def test_a_delay_keeps_its_due_time_across_a_restart() -> None:
    core = make_core()
    await core.create_queue(
        "q", on_failure='function on_failure(m) return { action = "retry", delay_ms = 3000 } end'
    )
    (retried,) = await _leased(core, "q")
    await core.nack("q", retried)
    (delayed,) = await core.enqueue("q", delay_ms=5000)
    await core.advance(1000)
    core, report = restarted(core)
    await core.settle()
    assert report.delayed == 2 and core.depth("q") == (2, 0)
    consumer = await core.attach("q")
    await core.advance(1999)
    assert core.take(consumer) == []
    await core.advance(1)
    (again,) = core.receive(consumer)
    assert (again.id, again.metadata.attempt_count) == (retried, 1)
    await core.ack("q", retried)
    await core.advance(1999)
    assert core.take(consumer) == []
    await core.advance(1)
    assert core.take(consumer) == [delayed]


@run_async
async def test_a_dead_letter_stays_in_the_dlq_across_a_restart() -> None:
    core = make_core()
    await core.create_queue("jobs", on_failure=BY_FATE)
    (message_id,) = await core.enqueue_each("jobs", [{"fate": "dlq"}])
    consumer = await core.attach("jobs")
    core.take(consumer)
    await core.nack("jobs", message_id)
    core, _ = restarted(core)
    await core.settle()
    assert core.depth("jobs") == (0, 0) and core.depth("jobs.dlq") == (1, 0)
    assert core.attempts("jobs.dlq") == {message_id: 1}
    assert core.take(await core.attach("jobs")) == []


@run_async
async def test_a_deleted_queue_stays_deleted_with_all_its_messages() -> None:
    core = make_core()
    await core.create_queue("doomed", on_failure=BY_FATE)
    await core.create_queue("keeper")
    (kept,) = await core.enqueue("keeper")
    # one message in each state: dead-lettered, delayed, leased, ready
    to_dlq, to_delay, _ = await core.enqueue_each(
        "doomed", [{"fate": "dlq"}, {"fate": "later"}, {}]
    )
    assert len(await _delivered(core, "doomed", 3)) == 3
    await core.nack("doomed", to_dlq, to_delay)
    await core.enqueue("doomed", 3)
    assert core.depth("doomed") == (4, 1) and core.depth("doomed.dlq") == (1, 0)
    await core.delete_queue("doomed")
    core, report = restarted(core)
    await core.settle()
    assert core.queue_names() == ["keeper", "keeper.dlq"]
    assert (report.ready, report.leased, report.delayed, report.orphans) == (1, 0, 0, 0)
    assert core.stored(keys.LEASE) == [] and core.stored(keys.DELAY) == []
    await core.create_queue("doomed")
    assert core.depth("doomed") == (0, 0) and core.depth("doomed.dlq") == (0, 0)
    assert core.attempts("keeper") == {kept: 0}


# -- the clock stepped between two runs ----------------------------------------------------------


@run_async
async def test_a_lease_and_a_delay_stored_before_a_step_back_last_at_most_their_length() -> None:
    """The broker stopped, the clock went back two hours, the broker started: the lease
    (1 s visibility timeout) and the 3 s delay it stored began "in the future". Each
    lasts at most its length from the restart, not two hours more."""
    core = make_core(queues=["q"])
    (leased,) = await _leased(core, "q")
    (delayed,) = await core.enqueue("q", delay_ms=3000)
    core.clock.advance(-2 * HOUR_MS)
    core, report = restarted(core)
    await core.settle()
    assert (report.leased, report.delayed) == (1, 1)
    await core.advance(1000)
    assert core.depth("q") == (2, 0) and core.delayed("q") == 1
    assert core.stats("q").counters.expired == 1
    await core.advance(2000)
    assert core.delayed("q") == 0
    consumer = await core.attach("q")
    assert sorted(core.take(consumer)) == sorted([leased, delayed])


@run_async
async def test_waits_stored_before_a_step_forward_end_by_the_clock() -> None:
    """Stepped forward between runs: the lease's deadline passed, so it counts as an
    expired delivery, and the delay is due; nothing waits longer than it would have."""
    core = make_core(queues=["q"])
    await _leased(core, "q")
    await core.enqueue("q", delay_ms=3000)
    core.clock.advance(2 * HOUR_MS)
    core, report = restarted(core)
    await core.settle()
    assert (report.leased, report.expired) == (0, 1)
    await core.advance(0)
    assert core.delayed("q") == 0 and core.depth("q") == (2, 0)
