"""Deliveries from the records the committer kept since their write (fila.storage.recent).

docs/operations.md, The disk: the broker keeps the message records it writes in memory
until they are delivered, up to `storage.recent_records_bytes`, so a consumer that
keeps up is served without reading each one back; past the budget, and for anything
not kept, deliveries read storage as before. What a consumer receives is the same
either way: the record storage holds for that message at that moment.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from support.core import CoreBroker, config, make_core, run_async

from fila.storage import keys
from fila.storage.recent import ENTRY_OVERHEAD_BYTES, RecentRecords


@contextmanager
def _counted_reads(core: CoreBroker) -> Iterator[list[bytes]]:
    """Records every storage read of a message record while the block runs."""
    reads: list[bytes] = []
    get = core.storage.get

    def counted(key: bytes) -> bytes | None:
        if key.startswith(keys.MESSAGE):
            reads.append(key)
        return get(key)

    core.storage.get = counted  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        core.storage.get = get  # type: ignore[method-assign]


@run_async
async def test_a_consumer_that_keeps_up_is_served_without_reading_storage() -> None:
    core = make_core(queues=["q"])
    consumer = await core.attach("q", prefetch=10)
    with _counted_reads(core) as reads:
        ids = await core.enqueue("q", 5)
        received = core.receive(consumer)
    assert [m.id for m in received] == ids
    assert [m.payload for m in received] == [b"0", b"1", b"2", b"3", b"4"]
    assert reads == []
    assert len(core.committer.recent) == 0  # given up as they were delivered


@run_async
async def test_with_no_budget_every_delivery_reads_its_record() -> None:
    core = make_core(queues=["q"], config=config("[storage]\nrecent_records_bytes = 0\n"))
    consumer = await core.attach("q", prefetch=10)
    with _counted_reads(core) as reads:
        ids = await core.enqueue("q", 3)
        assert core.take(consumer) == ids
    assert len(reads) == 3


@run_async
async def test_past_the_budget_deliveries_read_storage_and_receive_the_same() -> None:
    record_bytes = 200  # about what a small message's record takes here
    budget = 2 * (record_bytes + ENTRY_OVERHEAD_BYTES)
    core = make_core(queues=["q"], config=config(f"[storage]\nrecent_records_bytes = {budget}\n"))
    ids = await core.enqueue("q", 6)
    assert 0 < len(core.committer.recent) < 6
    with _counted_reads(core) as reads:
        consumer = await core.attach("q", prefetch=10)  # the pump runs here
        received = core.receive(consumer)
    assert [m.id for m in received] == ids
    assert [m.payload for m in received] == [b"%d" % i for i in range(6)]
    assert 0 < len(reads) < 6


@run_async
async def test_a_retried_message_is_delivered_with_its_rewritten_record() -> None:
    core = make_core(queues=["q"])
    consumer = await core.attach("q", prefetch=10)
    (message_id,) = await core.enqueue("q")
    (first,) = core.receive(consumer)
    assert first.metadata.attempt_count == 0
    await core.nack("q", message_id, error="boom")
    (again,) = core.receive(consumer)
    assert (again.id, again.metadata.attempt_count) == (message_id, 1)
    assert again.metadata.last_error == "boom"


def test_a_rewrite_replaces_the_kept_record_and_a_delete_drops_it() -> None:
    recent = RecentRecords(10_000)
    key = keys.MESSAGE + bytes(16)
    recent.wrote(key, b"first")
    recent.wrote(key, b"second")
    assert recent.size == len(b"second") + ENTRY_OVERHEAD_BYTES
    assert recent.take(key) == b"second"
    assert recent.take(key) is None  # taken once
    recent.wrote(key, b"third")
    recent.deleted(key)
    assert (recent.take(key), recent.size) == (None, 0)


def test_only_message_records_within_the_budget_are_kept() -> None:
    recent = RecentRecords(2 * (10 + ENTRY_OVERHEAD_BYTES))
    recent.wrote(keys.lease_key(keys.MESSAGE + bytes(16)), b"x" * 10)
    assert len(recent) == 0
    for i in range(3):
        recent.wrote(keys.MESSAGE + bytes([i]) * 16, b"x" * 10)
    assert len(recent) == 2  # the third did not fit
    assert recent.take(keys.MESSAGE + bytes([2]) * 16) is None


@run_async
async def test_records_of_a_deleted_queue_are_not_kept() -> None:
    core = make_core(queues=["q"])
    await core.enqueue("q", 3)
    assert len(core.committer.recent) == 3
    await core.delete_queue("q")
    assert (len(core.committer.recent), core.committer.recent.size) == (0, 0)
