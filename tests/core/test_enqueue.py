"""Enqueue: what the core checks and stores, and when the answer and the delivery may
happen.

SPEC 2, Enqueue: the broker assigns a time-ordered id (UUIDv7), runs `on_enqueue`,
stores the message, and only then answers; in sync mode the write is fsynced first.
A message becomes deliverable only once its write is committed. docs/semantics.md,
Batch paths: each item of a batch is checked and stored on its own.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from support.core import CoreBroker, config, make_core, run_async

from fila.core.errors import InvalidArgument, QueueNotFound, ResourceExhausted
from fila.v1 import service_pb2


@contextmanager
def _sync_held(core: CoreBroker) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Holds every fsync on the fsync thread until the second event is set."""
    started, release = threading.Event(), threading.Event()
    sync = core.storage.sync

    def held_sync() -> None:
        started.set()
        release.wait(10)
        sync()

    core.storage.sync = held_sync  # type: ignore[method-assign]
    try:
        yield started, release
    finally:
        release.set()
        core.storage.sync = sync  # type: ignore[method-assign]


@run_async
async def test_sync_mode_answers_only_after_a_sync() -> None:
    """The enqueue's answer waits for the fsync of its write: with the sync held on the
    fsync thread, the answer stays pending however long the loop runs."""
    core = make_core(persist_mode="sync", queues=["q"])
    await core.settle()
    syncs = core.storage.sync_count
    with _sync_held(core) as (started, release):
        _, committed = core.start_enqueue([service_pb2.EnqueueRequest(queue="q")])
        assert await asyncio.to_thread(started.wait, 10), "no sync started"
        for _ in range(20):  # every turn the loop could take to answer early
            await asyncio.sleep(0)
        assert not committed.done(), "answered before its write was synced"
        release.set()
        await committed
    assert core.storage.sync_count == syncs + 1


@run_async
async def test_a_message_is_deliverable_only_once_its_write_is_synced() -> None:
    core = make_core(persist_mode="sync", queues=["q"])
    consumer = await core.attach("q")
    with _sync_held(core) as (started, release):
        (message_id,), committed = core.start_enqueue([service_pb2.EnqueueRequest(queue="q")])
        assert await asyncio.to_thread(started.wait, 10)
        for _ in range(20):
            await asyncio.sleep(0)
        assert core.depth("q") == (1, 0), "it counts in depth meanwhile"
        assert core.take(consumer) == [], "a consumer never sees what could still be lost"
        release.set()
        await committed
    await core.settle()
    assert core.take(consumer) == [message_id]


@run_async
async def test_each_item_of_a_batch_is_checked_and_stored_on_its_own() -> None:
    core = make_core(
        config=config("[server]\nmax_message_bytes = 100\nmax_headers = 2\n"),
        queues=["q"],
    )
    results = await core.enqueue_requests(
        [
            service_pb2.EnqueueRequest(queue="q", payload=b"first"),
            service_pb2.EnqueueRequest(queue="nope"),
            service_pb2.EnqueueRequest(queue="q", payload=bytes(101)),
            service_pb2.EnqueueRequest(queue="q", headers={"a": "1", "b": "2", "c": "3"}),
            service_pb2.EnqueueRequest(queue="bad/name"),
            service_pb2.EnqueueRequest(queue="q", payload=bytes(100)),
        ]
    )
    assert [type(r).__name__ for r in results] == [
        "str",
        "QueueNotFound",
        "InvalidArgument",
        "InvalidArgument",
        "InvalidArgument",
        "str",
    ]
    assert isinstance(results[1], QueueNotFound) and isinstance(results[2], InvalidArgument)
    assert "the limit is 100" in str(results[2]) and "the limit is 2" in str(results[3])
    stored = [m.id for m in core.peek("q")[0]]
    assert stored == [results[0], results[5]]
    assert core.stats("q").counters.enqueued == 2


@run_async
async def test_a_full_queue_refuses_what_does_not_fit_counting_the_batch_so_far() -> None:
    core = make_core(config=config("[server]\nmax_queue_depth = 3\n"), queues=["q"])
    (first,) = await core.enqueue("q")
    results = await core.enqueue_requests([service_pb2.EnqueueRequest(queue="q") for _ in "abcd"])
    assert [isinstance(r, str) for r in results] == [True, True, False, False]
    assert isinstance(results[2], ResourceExhausted)
    assert "is full: 3 messages, the limit is 3" in str(results[2])
    consumer = await core.attach("q", prefetch=1)
    assert core.take(consumer) == [first]
    assert core.depth("q") == (2, 1)
    (more,) = await core.enqueue("q")
    assert isinstance(more, str), "a leased message does not count against the depth"


@run_async
async def test_ids_are_uuidv7_in_enqueue_order_stamped_with_the_brokers_clock() -> None:
    core = make_core(queues=["q"])
    first = await core.enqueue("q", 3, headers={"h": "ü"})
    core.clock.advance(5)
    later = await core.enqueue("q", 2)
    ids = first + later
    assert ids == sorted(ids) and len(set(ids)) == 5
    for message_id in ids:
        parsed = uuid.UUID(message_id)
        assert (parsed.version, str(parsed)) == (7, message_id)
    page, _ = core.peek("q")
    stamps = [m.timestamps.enqueued_at.ToMilliseconds() for m in page]
    assert stamps == [core.now_ms() - 5] * 3 + [core.now_ms()] * 2
    assert [uuid.UUID(m).int >> 80 for m in ids] == stamps
    assert dict(page[0].headers) == {"h": "ü"} and page[0].payload == b"0"
