"""Redrive in-process: a large DLQ moves in bounded chunks, one loop turn each, with
each chunk committed before the next; what happens to the queues meanwhile (a lease,
a purge, a delete, a shutdown, a crash) neither loses nor duplicates a message, and
the answer counts what moved.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

from support.core import CoreBroker, make_core, restarted

from fila.core.administration import REDRIVE_CHUNK_MESSAGES
from fila.core.records import message_id
from fila.storage import keys
from fila.v1 import messages_pb2, service_pb2

KEY_PER_MESSAGE = "function on_enqueue(m) return { fairness_key = m.headers.k } end"
TO_DLQ = 'function on_failure(m) return { action = "dlq" } end'
DEAD = 2_500  # dead letters, each with a fairness key of its own


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


async def _dead_letters(count: int = DEAD) -> tuple[CoreBroker, list[str]]:
    """A broker whose `jobs.dlq` holds `count` dead letters, one fairness key each."""
    core = make_core()
    await core.broker.create_queue("jobs", KEY_PER_MESSAGE, TO_DLQ, 60_000)
    requests = [
        service_pb2.EnqueueRequest(queue="jobs", headers={"k": f"k{i}"}, payload=b"%d" % i)
        for i in range(count)
    ]
    _, committed = core.broker.enqueue(requests)
    await committed
    await core.settle()
    consumer = core.broker.attach_consumer("jobs", prefetch=count, max_batch=count)
    await core.settle()
    ids = core.take(consumer)
    results, committed = core.broker.nack([("jobs", i, "boom") for i in ids])
    await committed
    assert results == [None] * count
    core.broker.detach_consumer(consumer)
    await core.settle()
    assert core.broker.queues["jobs.dlq"].drr.ready_count == count
    assert len(core.broker.queues["jobs.dlq"].drr.keys) == count
    return core, ids


def _ready_ids(core: CoreBroker, name: str) -> set[str]:
    drr = core.broker.queues[name].drr
    return {ref.id for ref in drr.upcoming()}


async def _after_first_chunk(core: CoreBroker, task: asyncio.Task[int]) -> None:
    """Waits (by loop turns, not time) until the redrive has moved its first chunk."""
    dlq = core.broker.queues["jobs.dlq"]
    while dlq.drr.ready_count == DEAD:
        assert not task.done()
        await asyncio.sleep(0)


def _stored_queue_ids(core: CoreBroker) -> dict[str, list[str]]:
    """Every stored message's id, by the queue its record names."""
    by_queue: dict[str, list[str]] = {}
    for key, value in core.storage.scan(keys.MESSAGE):
        record = messages_pb2.Message.FromString(value)
        by_queue.setdefault(record.metadata.queue_id, []).append(message_id(key))
    return by_queue


def test_a_redrive_moves_in_bounded_chunks_and_the_loop_serves_others_between_them() -> None:
    async def scenario() -> None:
        core, ids = await _dead_letters()
        await core.broker.create_queue("other", "", "", 1000)
        dlq = core.broker.queues["jobs.dlq"]
        task = asyncio.create_task(core.broker.redrive("jobs.dlq", 0))
        seen = [dlq.drr.ready_count]
        answered_during = False
        while not task.done():
            await asyncio.sleep(0)
            seen.append(dlq.drr.ready_count)
            if not answered_during and seen[-1] < DEAD:
                # an unrelated enqueue is answered while the redrive is still running
                await core.enqueue("other")
                answered_during = not task.done()
        assert await task == DEAD
        assert answered_during, "the enqueue waited for the whole redrive"
        steps = [before - after for before, after in itertools.pairwise(seen)]
        assert max(steps) <= REDRIVE_CHUNK_MESSAGES, "a chunk was larger than its bound"
        assert len([s for s in steps if s]) >= DEAD // REDRIVE_CHUNK_MESSAGES + 1
        await core.settle()
        assert _ready_ids(core, "jobs") == set(ids) and dlq.depth == 0
        assert core.broker.queues["jobs"].counters.redriven == DEAD

    run(scenario)


def test_a_redrive_moves_count_messages_over_several_chunks() -> None:
    async def scenario() -> None:
        core, ids = await _dead_letters()
        wanted = REDRIVE_CHUNK_MESSAGES + 300
        assert await core.broker.redrive("jobs.dlq", wanted) == wanted
        await core.settle()
        moved, left = _ready_ids(core, "jobs"), _ready_ids(core, "jobs.dlq")
        assert len(moved) == wanted and len(left) == DEAD - wanted
        assert moved | left == set(ids)

    run(scenario)


def test_messages_leased_during_a_redrive_stay_leased_in_the_dlq() -> None:
    async def scenario() -> None:
        core, ids = await _dead_letters()
        task = asyncio.create_task(core.broker.redrive("jobs.dlq", 0))
        await _after_first_chunk(core, task)
        reader = core.broker.attach_consumer("jobs.dlq", prefetch=100, max_batch=100)
        await core.settle()
        leased = core.take(reader)
        assert len(leased) == 100
        moved = await task
        await core.settle()
        assert moved == DEAD - 100
        assert _ready_ids(core, "jobs") == set(ids) - set(leased)
        dlq = core.broker.queues["jobs.dlq"]
        assert dlq.depth == 0 and {lease.ref.id for lease in dlq.leases} == set(leased)

    run(scenario)


def test_a_purge_during_a_redrive_ends_it_with_what_moved() -> None:
    async def scenario() -> None:
        core, _ = await _dead_letters()
        task = asyncio.create_task(core.broker.redrive("jobs.dlq", 0))
        await _after_first_chunk(core, task)
        purged, committed = core.broker.purge("jobs.dlq")
        await committed
        moved = await task
        await core.settle()
        assert 0 < moved < DEAD and moved + purged == DEAD
        assert len(_ready_ids(core, "jobs")) == moved
        stored = _stored_queue_ids(core)
        assert sorted(stored) == ["jobs"] and len(stored["jobs"]) == moved

    run(scenario)


def test_deleting_the_queue_during_a_redrive_ends_it_and_leaves_nothing() -> None:
    async def scenario() -> None:
        core, _ = await _dead_letters()
        task = asyncio.create_task(core.broker.redrive("jobs.dlq", 0))
        await _after_first_chunk(core, task)
        await core.broker.delete_queue("jobs")
        moved = await task
        await core.settle()
        assert 0 < moved < DEAD
        assert core.broker.queues == {} and _stored_queue_ids(core) == {}

    run(scenario)


def test_a_shutdown_during_a_redrive_ends_it_with_what_moved() -> None:
    async def scenario() -> None:
        core, _ = await _dead_letters()
        task = asyncio.create_task(core.broker.redrive("jobs.dlq", 0))
        await _after_first_chunk(core, task)
        core.broker.close()
        moved = await task
        assert 0 < moved < DEAD
        stored = _stored_queue_ids(core)
        assert len(stored["jobs"]) == moved and len(stored["jobs.dlq"]) == DEAD - moved

    run(scenario)


def test_a_crash_during_a_redrive_loses_and_duplicates_nothing() -> None:
    async def scenario() -> None:
        core, ids = await _dead_letters()
        task = asyncio.create_task(core.broker.redrive("jobs.dlq", 0))
        await _after_first_chunk(core, task)
        await asyncio.sleep(0)  # and then some
        after, _ = restarted(core)  # the storage as a kill -9 leaves it, recovered
        task.cancel()
        moved, left = _ready_ids(after, "jobs"), _ready_ids(after, "jobs.dlq")
        assert moved and left, "the crash was not in the middle of the redrive"
        assert moved | left == set(ids) and not moved & left
        for ref in after.broker.queues["jobs"].drr.upcoming():
            assert ref.attempt_count == 0 and ref.fairness_key.startswith("k")
        # the rest moves with a second redrive, once
        assert await after.broker.redrive("jobs.dlq", 0) == len(left)
        await after.settle()
        assert _ready_ids(after, "jobs") == set(ids)

    run(scenario)
