"""A dead-letter queue whose queue's record was lost (an orphan DLQ) can be taken back,
and a queue whose DLQ's record was lost gets its DLQ back.

`fila-server --repair` skips damaged blocks; when the block it skips holds the record
of `orders` but not that of `orders.dlq`, the broker starts with the DLQ and without
its queue, and the messages of `orders` are kept but unreachable. docs/operations.md
says they come back when the queue is created again and the broker restarted, so
creating `orders` must adopt the orphaned `orders.dlq` (its messages kept) instead of
answering that `orders.dlq` already exists, and the orphan may also be deleted on its
own. A DLQ whose queue is alive keeps the normal rules.

The reverse damage, `orders.dlq`'s record gone and `orders`'s kept, has no way back
by hand (".dlq" names are reserved): a nack to "dlq" would retry instead and the
DLQ's stored messages would stay unreachable. Recovery recreates the DLQ from its
queue, as CreateQueue made it, writes it back and logs it.

A record whose dead-letter link disagrees with its name (`orders.dlq` saying it is
the DLQ of `billing`, or of nothing; `orders` saying it is a DLQ) is corrected from
the name at startup, written back and logged: `orders` dead-letters into
`orders.dlq` by name, so a Redrive that followed the stored link would move its dead
letters into `billing`.

The damage is written directly: the records exactly as recovery finds them after
such a repair (one queue record gone, everything else kept), first on in-memory
storage through the core, then in a real data directory under a real fila-server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import grpc
import pytest
from support import ServerFactory
from support.core import CoreBroker, make_core, restarted
from support.stubs import RPC_TIMEOUT_S, connect, status_of

from fila.config import Config, parse_config
from fila.core.errors import InvalidArgument, QueueAlreadyExists
from fila.core.queue import QueueRecord
from fila.core.recovery import RecoveryReport
from fila.storage import keys
from fila.storage.backend import Batch, RocksStorage
from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2

TO_DLQ = 'function on_failure(m) return { action = "dlq" } end'


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


def _lose_record(core: CoreBroker, name: str) -> None:
    """What a repair that skipped the block holding only `name`'s record leaves."""
    batch = Batch()
    batch.delete(keys.queue_key(name))
    core.storage.write(batch)


async def _orders_and_billing() -> CoreBroker:
    """Two queues that dead-letter on failure, `orders` with one dead letter."""
    core = make_core()
    for name in ("orders", "billing"):
        await core.broker.create_queue(name, "", TO_DLQ, 5000)
    await _dead_letter(core, "orders", 1)
    return core


async def _redrive_all(core: CoreBroker, dlq: str) -> int:
    """Redrives every message of `dlq` into its queue; returns how many moved."""
    redriven = await core.broker.redrive(dlq, 0)
    await core.settle()
    return redriven


async def _dead_letter(core: CoreBroker, queue: str, count: int) -> list[str]:
    """Enqueues `count` messages on `queue` (whose on_failure is `TO_DLQ`, and which
    holds nothing ready yet) and nacks each into the DLQ; returns their ids."""
    dead = await core.enqueue(queue, count)
    consumer = core.broker.attach_consumer(queue)
    await core.settle()
    assert core.take(consumer) == dead
    results, committed = core.broker.nack([(queue, m, "boom") for m in dead])
    await committed
    assert results == [None] * count
    core.broker.detach_consumer(consumer)
    await core.settle()
    return dead


async def _orphaned(config: Config | None = None) -> tuple[CoreBroker, RecoveryReport]:
    """A broker started on data where `orders` (3 messages) lost its record and
    `orders.dlq` (1 dead-lettered message) kept its own."""
    core = make_core()
    await core.broker.create_queue("orders", "", TO_DLQ, 1000)
    await _dead_letter(core, "orders", 1)
    await core.enqueue("orders", 3)
    _lose_record(core, "orders")
    return restarted(core, config)


def _stored(core: CoreBroker, name: str) -> QueueRecord | None:
    raw = core.storage.get(keys.queue_key(name))
    return None if raw is None else QueueRecord.decode(raw)


def _lose_queue_record(server: ServerProcess, name: str) -> None:
    """Deletes queue `name`'s record from a stopped broker's storage, as damage would."""
    storage = RocksStorage(server.data_dir)
    try:
        batch = Batch()
        batch.delete(keys.queue_key(name))
        storage.write(batch)
    finally:
        storage.close()


def test_creating_a_queue_again_adopts_its_orphaned_dlq_and_a_restart_brings_all_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        caplog.set_level(logging.ERROR, logger="fila.recovery")
        core, report = await _orphaned()
        # The orphan is served as the ordinary queue it is, and reported.
        assert report.orphans == 3 and report.orphan_dlqs == ["orders.dlq"]
        assert any("dead-letter queue's queue does not exist" in r.message for r in caplog.records)
        assert [q.name for q in core.broker.list_queues()] == ["orders.dlq"]
        assert core.broker.stats("orders.dlq").depth == 1

        await core.broker.create_queue("orders", "", TO_DLQ, 5000)
        assert [q.name for q in core.broker.list_queues()] == ["orders", "orders.dlq"]
        dlq = core.broker.queues["orders.dlq"]
        assert dlq.depth == 1, "the adopted DLQ lost its messages"
        assert dlq.record.visibility_timeout_ms == 5000
        assert _stored(core, "orders.dlq") == dlq.record
        assert _stored(core, "orders") == core.broker.queues["orders"].record
        # adopted: the DLQ of a live queue again, so it goes only with that queue
        with pytest.raises(InvalidArgument, match="is the dead-letter queue of"):
            core.broker.delete_queue("orders.dlq")

        core, report = restarted(core)
        assert report.orphans == 0 and report.orphan_dlqs == []
        assert core.broker.stats("orders").depth == 3
        assert core.broker.stats("orders.dlq").depth == 1
        # and a redrive moves the dead letter home
        redriven = await _redrive_all(core, "orders.dlq")
        assert redriven == 1 and core.broker.stats("orders").depth == 4

    run(scenario)


def test_an_orphaned_dlq_may_be_deleted_on_its_own() -> None:
    async def scenario() -> None:
        core, _ = await _orphaned()
        await core.broker.delete_queue("orders.dlq")
        await core.settle()
        assert "orders.dlq" not in core.broker.queues
        assert _stored(core, "orders.dlq") is None
        stored = [m for m in core.storage.scan(keys.MESSAGE)]
        assert len(stored) == 3, "deleting the orphan touched the queue's own messages"
        await core.broker.create_queue("orders", "", "", 1000)  # a fresh DLQ
        assert core.broker.queues["orders.dlq"].depth == 0
        core, report = restarted(core)
        assert report.orphans == 0 and core.broker.stats("orders").depth == 3

    run(scenario)


def test_adopting_an_orphaned_dlq_counts_one_queue_against_max_queues() -> None:
    async def scenario() -> None:
        core, _ = await _orphaned(parse_config("[server]\nmax_queues = 1\n", "test"))
        await core.broker.create_queue("orders", "", "", 1000)
        assert sorted(core.broker.queues) == ["orders", "orders.dlq"]

    run(scenario)


def test_the_normal_rules_hold_for_a_dlq_with_a_live_queue_and_for_dlq_names() -> None:
    async def scenario() -> None:
        core = make_core(queues=["orders"])
        with pytest.raises(InvalidArgument, match="reserved for dead-letter queues"):
            core.broker.create_queue("orders.dlq", "", "", 1000)
        with pytest.raises(InvalidArgument, match="is the dead-letter queue of"):
            core.broker.delete_queue("orders.dlq")
        with pytest.raises(QueueAlreadyExists):
            core.broker.create_queue("orders", "", "", 1000)

    run(scenario)


def _put(key: bytes, value: bytes) -> Batch:
    batch = Batch()
    batch.put(key, value)
    return batch


def test_a_real_broker_takes_back_a_queue_whose_record_a_repair_lost(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("orders", on_failure=TO_DLQ)
        for i in range(5):
            fila.enqueue("orders", b"m%d" % i)
    server.stop()
    _lose_queue_record(server, "orders")

    server.start()
    assert "dead-letter queue's queue does not exist" in server.log_text()
    with connect(server.addr) as fila:
        assert fila.queue_names() == ["orders.dlq"]
        assert fila.stats("orders.dlq").depth == 0
        fila.create_queue("orders", on_failure=TO_DLQ)
        with pytest.raises(grpc.RpcError) as refused:
            fila.delete_queue("orders.dlq")
        assert status_of(refused.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    server.restart()
    with connect(server.addr) as fila:
        assert fila.queue_names() == ["orders", "orders.dlq"]
        assert fila.stats("orders").depth == 5, "the queue's messages did not come back"


def test_a_queue_whose_dlq_record_was_lost_gets_its_dlq_back_with_its_messages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        caplog.set_level(logging.WARNING, logger="fila.recovery")
        core = make_core()
        await core.broker.create_queue("orders", "", TO_DLQ, 5000)
        leased, ready = await _dead_letter(core, "orders", 2)
        # one dead letter is being consumed from the DLQ when the damage happens
        reader = core.broker.attach_consumer("orders.dlq", prefetch=1)
        await core.settle()
        assert core.take(reader) == [leased]
        core.broker.detach_consumer(reader)  # sent: stays leased
        await core.settle()
        assert core.broker.stats("orders.dlq").in_flight == 1
        await core.enqueue("orders", 2)
        lost = _stored(core, "orders.dlq")
        assert lost is not None
        _lose_record(core, "orders.dlq")

        core, report = restarted(core)
        assert report.recreated_dlqs == ["orders.dlq"]
        assert report.orphans == 0 and report.orphan_dlqs == []
        (warning,) = [r for r in caplog.records if "was recreated" in r.message]
        assert warning.levelno == logging.WARNING
        assert (warning.__dict__["dlq"], warning.__dict__["messages"]) == ("orders.dlq", 2)
        # The same record CreateQueue wrote, served and written back.
        dlq = core.broker.queues["orders.dlq"]
        assert dlq.record == lost and dlq.record.visibility_timeout_ms == 5000
        assert _stored(core, "orders.dlq") == lost
        assert [q.name for q in core.broker.list_queues()] == ["orders", "orders.dlq"]
        # Its stored messages are its own again: counted, peeked, settled.
        stats = core.broker.stats("orders.dlq")
        assert (stats.depth, stats.in_flight) == (1, 1)
        assert core.broker.stats("orders").depth == 2
        page, _ = await core.broker.peek("orders.dlq", 0, "", "")
        assert sorted(m.id for m in page) == sorted([ready, leased])
        results, committed = core.broker.ack([("orders.dlq", leased)])
        await committed
        assert results == [None]

        # A nack to "dlq" dead-letters again instead of retrying.
        consumer = core.broker.attach_consumer("orders")
        await core.settle()
        taken = core.take(consumer)
        assert len(taken) == 2
        results, committed = core.broker.nack([("orders", m, "boom") for m in taken])
        await committed
        await core.settle()
        assert results == [None, None]
        assert core.broker.queues["orders"].counters.dead_lettered == 2
        assert core.broker.stats("orders.dlq").depth == 3
        core.broker.detach_consumer(consumer)

        # The next start reads the written record: nothing to recreate, nothing lost.
        core, report = restarted(core)
        assert report.recreated_dlqs == [] and report.orphans == 0
        assert core.broker.stats("orders.dlq").depth == 3
        redriven = await _redrive_all(core, "orders.dlq")
        assert redriven == 3 and core.broker.stats("orders").depth == 3

    run(scenario)


def test_a_real_broker_recreates_a_dlq_whose_record_a_repair_lost(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("orders", on_failure=TO_DLQ)
        dead = fila.enqueue("orders", b"dead")
        with fila.consume("orders") as stream:
            assert stream.get().id == dead
            fila.nack("orders", dead, "boom")
        assert fila.stats("orders.dlq").depth == 1
        fila.enqueue("orders", b"next")
    server.stop()
    _lose_queue_record(server, "orders.dlq")

    server.start()
    assert "dead-letter queue had no record" in server.log_text()
    with connect(server.addr) as fila:
        assert fila.queue_names() == ["orders", "orders.dlq"]
        assert fila.stats("orders.dlq").depth == 1, "the DLQ's stored message is not served"
        with fila.consume("orders") as stream:
            retried = stream.get().id
            fila.nack("orders", retried, "boom")
        assert fila.stats("orders.dlq").depth == 2, "the nack did not dead-letter"
    server.restart()
    with connect(server.addr) as fila:
        assert fila.queue_names() == ["orders", "orders.dlq"]
        assert fila.stats("orders.dlq").depth == 2
        redriven = fila.admin.Redrive(
            admin_pb2.RedriveRequest(dlq_queue="orders.dlq"), timeout=RPC_TIMEOUT_S
        )
        assert redriven.redriven == 2 and fila.stats("orders").depth == 2
    assert server.log_text().count("dead-letter queue had no record") == 1


def _store(core: CoreBroker, record: QueueRecord) -> None:
    """Writes `record` as its queue's stored record, as damage would."""
    core.storage.write(_put(keys.queue_key(record.name), record.encode()))


_QUEUES = ("orders", "orders.dlq", "billing", "billing.dlq")


@pytest.mark.parametrize(
    ("damaged", "stored_dlq_of"),
    [("orders.dlq", "billing"), ("orders.dlq", ""), ("orders", "billing")],
    ids=["dlq-names-another-queue", "dlq-names-none", "queue-names-a-queue"],
)
def test_a_record_whose_dlq_link_disagrees_with_its_name_is_corrected_from_the_name(
    damaged: str, stored_dlq_of: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The stored link of one record is wrong, everything else as CreateQueue wrote it.
    Recovery puts back exactly the records CreateQueue wrote (no queue added: a DLQ
    stored as an ordinary queue once got a DLQ of its own), writes them, and logs one
    warning; `orders` then dead-letters into `orders.dlq` and a Redrive brings the
    dead letters back to `orders`, never into `billing`."""

    async def scenario() -> None:
        caplog.set_level(logging.WARNING, logger="fila.recovery")
        core = await _orders_and_billing()
        written = {name: _stored(core, name) for name in _QUEUES}
        stored = written[damaged]
        assert stored is not None
        _store(core, replace(stored, dlq_of=stored_dlq_of))

        core, report = restarted(core)
        assert report.relinked_queues == [(damaged, stored_dlq_of)]
        assert report.recreated_dlqs == [] and report.orphan_dlqs == []
        (warning,) = [r for r in caplog.records if "dead-letter link disagreed" in r.message]
        assert warning.levelno == logging.WARNING
        fields = tuple(warning.__dict__[f] for f in ("queue", "stored_dlq_of", "dlq_of"))
        assert fields == (damaged, stored_dlq_of, "" if damaged == "orders" else "orders")
        assert sorted(core.broker.queues) == sorted(_QUEUES)
        for name, record in written.items():
            assert core.broker.queues[name].record == record
            assert _stored(core, name) == record

        await _dead_letter(core, "orders", 1)
        assert core.broker.stats("orders.dlq").depth == 2
        redriven = await _redrive_all(core, "orders.dlq")
        assert redriven == 2
        assert core.broker.stats("orders").depth == 2
        assert core.broker.stats("billing").depth == 0

        core, report = restarted(core)  # the corrected record was written: nothing to do
        assert report.relinked_queues == []
        assert len([r for r in caplog.records if "dead-letter link disagreed" in r.message]) == 1

    run(scenario)


def test_an_orphaned_dlq_whose_record_names_another_queue_is_taken_back_by_its_own(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`orders` lost its record and `orders.dlq`'s names `billing`, a live queue: it
    was served as `billing`'s without a word, creating `orders` answered that
    `orders.dlq` exists, and deleting it was refused ("the dead-letter queue of
    billing"), so nothing could take it back. Its link is corrected to `orders`:
    an orphan DLQ like any other, reported, and adopted when `orders` is created."""

    async def scenario() -> None:
        caplog.set_level(logging.WARNING, logger="fila.recovery")
        core = await _orders_and_billing()
        await core.enqueue("orders", 3)
        stored = _stored(core, "orders.dlq")
        assert stored is not None
        _store(core, replace(stored, dlq_of="billing"))
        _lose_record(core, "orders")

        core, report = restarted(core)
        assert report.relinked_queues == [("orders.dlq", "billing")]
        assert report.orphan_dlqs == ["orders.dlq"] and report.orphans == 3
        assert core.broker.queues["orders.dlq"].record == replace(stored, dlq_of="orders")
        messages = [r.message for r in caplog.records]
        assert any("dead-letter link disagreed" in m for m in messages)
        assert any("dead-letter queue's queue does not exist" in m for m in messages)

        await core.broker.create_queue("orders", "", TO_DLQ, 5000)
        assert core.broker.stats("orders.dlq").depth == 1
        core, report = restarted(core)
        assert report.relinked_queues == [] and report.orphans == 0
        assert core.broker.stats("orders").depth == 3
        redriven = await _redrive_all(core, "orders.dlq")
        assert redriven == 1 and core.broker.stats("orders").depth == 4
        assert core.broker.stats("billing").depth == 0

    run(scenario)


def _relink_queue_record(server: ServerProcess, name: str, dlq_of: str) -> None:
    """Rewrites queue `name`'s record in a stopped broker's storage with another
    `dlq_of`, as damage would."""
    storage = RocksStorage(server.data_dir)
    try:
        raw = storage.get(keys.queue_key(name))
        assert raw is not None
        damaged = replace(QueueRecord.decode(raw), dlq_of=dlq_of)
        storage.write(_put(keys.queue_key(name), damaged.encode()))
    finally:
        storage.close()


def test_a_real_broker_corrects_a_dlq_whose_record_names_another_queue(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("orders", on_failure=TO_DLQ)
        fila.create_queue("billing")
        dead = fila.enqueue("orders", b"dead")
        with fila.consume("orders") as stream:
            assert stream.get().id == dead
            fila.nack("orders", dead, "boom")
        assert fila.stats("orders.dlq").depth == 1
    server.stop()
    _relink_queue_record(server, "orders.dlq", "billing")

    server.start()
    assert "dead-letter link disagreed with its name" in server.log_text()
    with connect(server.addr) as fila:
        redriven = fila.admin.Redrive(
            admin_pb2.RedriveRequest(dlq_queue="orders.dlq"), timeout=RPC_TIMEOUT_S
        )
        assert redriven.redriven == 1
        assert (fila.stats("orders").depth, fila.stats("billing").depth) == (1, 0)
    server.restart()
    assert server.log_text().count("dead-letter link disagreed") == 1
