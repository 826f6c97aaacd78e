"""Queues: creating and deleting them, and what an operator sees and changes inside
one (stats, peek, purge).

SPEC 2: creating `orders` also creates `orders.dlq`; deleting a queue deletes its
messages, leases and DLQ. SPEC 1 (job-queue additions): PeekMessages lists ready,
delayed and leased messages in id order and changes nothing; PurgeQueue deletes the
ready and delayed ones and leaves leased ones to finish. Stats count what happened.
"""

from __future__ import annotations

import asyncio

import pytest
from support.core import CoreBroker, config, make_core, restarted, run_async

from fila.core import administration, removal
from fila.core.errors import (
    InvalidArgument,
    MessageNotFound,
    QueueAlreadyExists,
    QueueNotFound,
    ResourceExhausted,
    Unavailable,
)
from fila.storage import keys
from fila.storage.backend import Batch

TENANT = "function on_enqueue(m) return { fairness_key = m.headers.tenant } end"


# -- create and delete ------------------------------------------------------------------------


@run_async
async def test_creating_a_queue_creates_its_dead_letter_queue_too() -> None:
    core = make_core()
    assert core.queue_names() == []
    await core.create_queue("orders")
    assert core.queue_names() == ["orders", "orders.dlq"]
    assert core.depth("orders.dlq") == (0, 0)
    assert len(core.stored(keys.QUEUE)) == 2


@pytest.mark.parametrize(
    ("name", "error", "words"),
    [
        ("", InvalidArgument, "must not be empty"),
        ("a/b", InvalidArgument, "may only contain"),
        ("x" * 256, InvalidArgument, "the limit is 255"),
        ("orders.dlq", InvalidArgument, "reserved for dead-letter queues"),
        ("orders", QueueAlreadyExists, "orders"),
    ],
)
@run_async
async def test_a_queue_name_that_is_invalid_reserved_or_taken_is_refused(
    name: str, error: type[Exception], words: str
) -> None:
    core = make_core(queues=["orders"])
    with pytest.raises(error, match=words):
        await core.create_queue(name)
    assert core.queue_names() == ["orders", "orders.dlq"]


@run_async
async def test_max_queues_counts_a_queue_and_its_dlq_as_one() -> None:
    core = make_core(config=config("[server]\nmax_queues = 2\n"), queues=["a", "b"])
    with pytest.raises(ResourceExhausted, match="the limit is 2"):
        await core.create_queue("c")
    await core.delete_queue("a")
    await core.create_queue("c")
    assert core.queue_names() == ["b", "b.dlq", "c", "c.dlq"]


@run_async
async def test_deleting_a_queue_deletes_its_dlq_its_messages_and_its_leases() -> None:
    core = make_core()
    await core.create_queue("gone", on_failure='function on_failure(m) return {action="dlq"} end')
    await core.create_queue("kept")
    (kept,) = await core.enqueue("kept")
    dead, leased, _ = await core.enqueue("gone", 3)
    await core.enqueue("gone", delay_ms=1000)
    consumer = await core.attach("gone", prefetch=2, max_batch=2)
    assert core.take(consumer) == [dead, leased]
    await core.nack("gone", dead)
    await core.delete_queue("gone")
    assert core.queue_names() == ["kept", "kept.dlq"]
    with pytest.raises(QueueNotFound):
        core.receive(consumer)  # its stream ends with NOT_FOUND
    assert isinstance((await core.ack("gone", leased))[0], QueueNotFound)
    with pytest.raises(QueueNotFound):
        core.stats("gone.dlq")
    assert core.stored(keys.MESSAGE) == [keys.MESSAGE + bytes.fromhex(kept.replace("-", ""))]
    assert core.stored(keys.LEASE) == [] and core.stored(keys.DELAY) == []
    await core.create_queue("gone")
    assert core.depth("gone") == (0, 0) and core.depth("gone.dlq") == (0, 0)


@run_async
async def test_every_write_of_a_queues_messages_leases_and_delays_names_the_queue() -> None:
    """What replication goes by (`Committer.put`/`delete`'s queue): each record of a
    message, its lease or its delay is written and deleted under its queue's name,
    through every way it changes, the queue's deletion included."""
    core = make_core(queues=["q", "other"])
    writes: list[tuple[bytes, str | None]] = []

    def hook(batch: Batch, tags: list[str | None]) -> None:
        writes.extend((key, tag) for (key, _), tag in zip(batch.ops, tags, strict=True))

    core.committer.set_hook(hook)
    (elsewhere,) = await core.enqueue("other")
    extended, nacked, acked = await core.enqueue("q", 3)
    await core.enqueue("q", delay_ms=10)
    consumer = await core.attach("q", prefetch=3, max_batch=3)
    assert core.take(consumer) == [extended, nacked, acked]
    await core.extend("q", extended, 5000)
    await core.nack("q", nacked)
    await core.ack("q", acked)
    await core.advance(10)
    await core.delete_queue("q")
    elsewhere_raw = bytes.fromhex(elsewhere.replace("-", ""))
    records = [(k, tag) for k, tag in writes if k[:1] in (keys.MESSAGE, keys.LEASE, keys.DELAY)]
    assert records and all(
        tag == ("other" if elsewhere_raw in key else "q") for key, tag in records
    ), records
    kinds = {(key[:1], tag) for key, tag in records}
    assert {(keys.LEASE, "q"), (keys.DELAY, "q"), (keys.MESSAGE, "other")} <= kinds


@run_async
async def test_a_dlq_cannot_be_deleted_while_its_queue_exists() -> None:
    core = make_core(queues=["q"])
    with pytest.raises(InvalidArgument, match="delete that queue instead"):
        await core.delete_queue("q.dlq")
    assert core.queue_names() == ["q", "q.dlq"]


# -- peek and purge ---------------------------------------------------------------------------


@run_async
async def test_peek_lists_ready_delayed_and_leased_messages_in_id_order_and_changes_nothing() -> (
    None
):
    core = make_core()
    await core.create_queue("q", on_enqueue=TENANT)
    ids = await core.enqueue_each("q", [{"tenant": "ab"[i % 2]} for i in range(10)])
    (delayed,) = await core.enqueue("q", delay_ms=60_000, headers={"tenant": "a"})
    ids.append(delayed)
    consumer = await core.attach("q", prefetch=1)
    (leased,) = core.take(consumer)
    before = (core.depth("q"), core.attempts("q"), core.stats("q").counters.delivered)
    page, after = core.peek("q")
    assert [m.id for m in page] == ids and after == ""
    by_id = {m.id: m for m in page}
    assert by_id[leased].timestamps.HasField("leased_at")
    assert not by_id[delayed].timestamps.HasField("leased_at")
    first, after = core.peek("q", limit=4)
    assert [m.id for m in first] == ids[:4] and after == ids[3]
    second, after = core.peek("q", limit=4, after_id=after)
    assert [m.id for m in second] == ids[4:8] and after == ids[7]
    last, after = core.peek("q", limit=4, after_id=after)
    assert [m.id for m in last] == ids[8:] and after == ""
    only_b, _ = core.peek("q", fairness_key="b")
    assert [m.id for m in only_b] == ids[1:10:2]
    assert (core.depth("q"), core.attempts("q"), core.stats("q").counters.delivered) == before


@run_async
async def test_peek_refuses_an_after_id_that_is_not_an_id_and_a_queue_that_does_not_exist() -> None:
    core = make_core(queues=["q"])
    with pytest.raises(InvalidArgument, match="not a message id"):
        core.peek("q", after_id="not-an-id")
    with pytest.raises(QueueNotFound):
        core.peek("nope")


@run_async
async def test_purge_and_peek_see_the_same_messages() -> None:
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 5)
    page, after = core.peek("q", limit=3)
    assert [m.id for m in page] == ids[:3] and after == ids[2]
    assert await core.purge("q") == 5
    assert core.depth("q") == (0, 0)
    assert core.peek("q", limit=10) == ([], "")


@run_async
async def test_purge_deletes_ready_and_delayed_messages_and_leaves_leased_ones_to_finish() -> None:
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 5)
    await core.enqueue("q", delay_ms=60_000)
    consumer = await core.attach("q", prefetch=2, max_batch=2)
    held = core.take(consumer)
    assert await core.purge("q") == 4
    assert core.depth("q") == (0, 2)
    assert core.stats("q").counters.purged == 4
    assert await core.ack("q", *held) == [None, None]
    assert await core.purge("q") == 0
    assert core.stored(keys.MESSAGE) == [] and core.stored(keys.DELAY) == []
    assert held == ids[:2]
    with pytest.raises(QueueNotFound):
        await core.purge("nope")


# -- purge and delete at any size ------------------------------------------------------------
# Issue 29 (nothing a client asks for holds the loop): the messages leave memory at once,
# their records go a chunk per committed write (`fila.core.removal`), and a crash part-way
# leaves the rest, which repeating the call removes.

CHUNK = 10
BIG = 30 * CHUNK + 7


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(removal, "CHUNK_MESSAGES", CHUNK)


async def _fill(core: CoreBroker, queue: str) -> None:
    """BIG ready messages over two fairness keys, and CHUNK delayed ones."""
    await core.enqueue_each(queue, [{"tenant": "ab"[i % 2]} for i in range(BIG)])
    await core.enqueue(queue, CHUNK, delay_ms=60_000)


@run_async
async def test_a_large_purge_deletes_a_chunk_per_write_and_serves_others_between(
    small_chunks: None,
) -> None:
    core = make_core()
    await core.create_queue("q", on_enqueue=TENANT)
    await core.create_queue("other")
    await _fill(core, "q")
    writes = core.committer.batches_written
    count, purged = core.broker.purge("q")
    assert count == BIG + CHUNK
    assert core.depth("q") == (0, 0) and core.peek("q") == ([], "")  # gone from memory at once
    consumer = await core.attach("q", prefetch=100)
    answered = await core.enqueue("other")  # answered while the purge still runs
    assert answered and not purged.done()
    await purged
    assert core.take(consumer) == []
    assert core.stored(keys.DELAY) == []
    assert core.stored(keys.MESSAGE) == [keys.message_key(answered[0])]
    # records of BIG + CHUNK messages and CHUNK delay records, at most CHUNK per write
    assert core.committer.batches_written - writes >= (BIG + 3 * CHUNK) // CHUNK


@run_async
async def test_a_purge_cut_short_by_a_shutdown_leaves_the_rest_which_a_repeat_removes(
    small_chunks: None,
) -> None:
    core = make_core()
    await core.create_queue("q", on_enqueue=TENANT)
    await _fill(core, "q")
    _, purged = core.broker.purge("q")
    await asyncio.sleep(0)  # its first chunk is in the open write
    core.broker.close()
    with pytest.raises(Unavailable, match="stopped part-way"):
        await purged
    core, _ = restarted(core)
    left = core.depth("q")[0]
    assert 0 < left < BIG + CHUNK, "the shutdown was not in the middle of the purge"
    assert await core.purge("q") == left
    assert core.stored(keys.MESSAGE) == [] and core.stored(keys.DELAY) == []


@run_async
async def test_a_purge_whose_caller_went_away_still_finishes(small_chunks: None) -> None:
    core = make_core(queues=["q"])
    await core.enqueue("q", BIG)
    _, purged = core.broker.purge("q")
    purged.cancel()  # the client hung up
    await core.enqueue("q", 0)  # an empty batch: one more commit to wait on
    for _ in range(BIG):
        await core.settle()
    assert core.stored(keys.MESSAGE) == []


@run_async
async def test_a_queue_being_deleted_keeps_its_name_until_its_records_are_gone(
    small_chunks: None,
) -> None:
    core = make_core()
    await core.create_queue("q", on_enqueue=TENANT)
    await _fill(core, "q")
    deleted = core.broker.delete_queue("q")
    assert "q" not in core.queue_names()
    with pytest.raises(Unavailable, match="still being deleted"):
        await core.create_queue("q")
    await deleted
    await core.create_queue("q")
    assert core.depth("q") == (0, 0)
    assert core.stored(keys.MESSAGE) == [] and core.stored(keys.DELAY) == []
    core, _ = restarted(core)
    assert core.depth("q") == (0, 0)  # nothing of the old queue came back into the new one


@run_async
async def test_a_deletion_cut_short_by_a_shutdown_leaves_the_queue_with_what_it_still_holds(
    small_chunks: None,
) -> None:
    core = make_core()
    await core.create_queue("q", on_enqueue=TENANT)
    await _fill(core, "q")
    deleted = core.broker.delete_queue("q")
    await asyncio.sleep(0)
    core.broker.close()
    with pytest.raises(Unavailable, match="stopped part-way"):
        await deleted
    core, report = restarted(core)
    assert report.orphans == 0  # the queue records went last: no message lost its queue
    left = core.depth("q")[0]
    assert 0 < left < BIG + CHUNK, "the shutdown was not in the middle of the deletion"
    await core.delete_queue("q")
    assert core.queue_names() == []
    assert core.stored(keys.MESSAGE) == [] and core.stored(keys.QUEUE) == []


# -- stats ------------------------------------------------------------------------------------


@run_async
async def test_stats_over_many_fairness_keys_weigh_them_a_slice_per_turn_and_list_the_largest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Issue 29: GetStats over a million keys must not hold the loop.
    monkeypatch.setattr(administration, "STATS_KEYS_PER_TURN", 10)
    monkeypatch.setattr(administration, "MAX_LISTED_KEYS", 3)
    core = make_core()
    await core.create_queue("q", on_enqueue=TENANT)
    # key k{n} holds 35 - n messages: the largest three, k0 to k2, are in the first slice
    await core.enqueue_each("q", [{"tenant": f"k{n}"} for n in range(35) for _ in range(35 - n)])
    at_once = core.stats("q")
    task = asyncio.ensure_future(core.broker.stats_in_turns("q"))
    turns = 0
    while not task.done():
        await asyncio.sleep(0)
        turns += 1
    in_turns = task.result()
    assert turns >= 4, "the 35 keys were weighed in one turn"
    assert [k.key for k in in_turns.per_key] == ["k0", "k1", "k2"]
    assert in_turns.per_key == at_once.per_key
    assert in_turns.active_fairness_keys == 35


@run_async
async def test_stats_count_what_happened_to_the_queues_messages() -> None:
    core = make_core()
    await core.create_queue(
        "q",
        on_enqueue=TENANT,
        on_failure='function on_failure(m) if m.attempts >= 2 then return { action = "dlq" } '
        'end return { action = "retry" } end',
        visibility_timeout_ms=1000,
    )
    ids = await core.enqueue_each("q", [{"tenant": "ab"[i % 2]} for i in range(6)])
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    assert core.take(consumer) == ids
    await core.ack("q", *ids[:3])
    await core.nack("q", ids[3])
    assert core.take(consumer) == ids[3:4]
    await core.nack("q", ids[3])  # the second failure: dead-lettered
    await core.advance(1000)  # the last two expire and come back
    assert core.take(consumer) == ids[4:]
    await core.ack("q", *ids[4:])
    stats = core.stats("q")
    counters = stats.counters
    assert (
        counters.enqueued,
        counters.delivered,
        counters.acked,
        counters.nacked,
        counters.expired,
        counters.dead_lettered,
    ) == (6, 9, 5, 2, 2, 1)
    assert (stats.depth, stats.in_flight, stats.active_consumers) == (0, 0, 1)
    assert stats.per_key == [], "no backlog: no key listed"
    assert core.depth("q.dlq") == (1, 0)
    with pytest.raises(MessageNotFound):
        await core.extend("q", ids[3], 1000)
