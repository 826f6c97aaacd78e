"""A stored record that does not decode is set aside; it never stops the broker or the
work around it (in-process: the real core over in-memory storage and a manual clock).

The crafted-request paths that once produced such records, against a real broker, are
in tests/test_crafted_records.py; here the record is damaged in storage directly, as a
disk could, to pin what each reader of records does with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from support import until
from support.core import CoreBroker, make_core, restarted

from fila.clock import ManualClock
from fila.core.timers import Timers
from fila.storage import keys
from fila.storage.backend import Batch
from fila.v1 import messages_pb2, service_pb2

# A field 4 (metadata) holding an invalid UTF-8 fairness key: parses as nothing.
UNDECODABLE = b"\x22\x03\x0a\x01\xff"


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


def key_of(message_id: str) -> bytes:
    return keys.message_key(message_id)


def damage(core: CoreBroker, message_id: str, raw: bytes = UNDECODABLE) -> None:
    batch = Batch()
    batch.put(key_of(message_id), raw)
    core.storage.write(batch)


def set_aside(core: CoreBroker) -> dict[bytes, bytes]:
    return {keys.original_from_quarantine_key(k): v for k, v in core.storage.scan(keys.QUARANTINE)}


def test_an_expiry_bucket_with_a_bad_record_still_expires_the_others() -> None:
    """Five messages sent in one frame share one expiry entry; the bad one once raised
    out of the timer and left the other four in flight for ever."""

    async def scenario() -> None:
        core = make_core(queues=["q"])
        ids = await core.enqueue("q", 5)
        consumer = core.broker.attach_consumer("q", prefetch=5, max_batch=5)
        await core.settle()
        assert core.take(consumer) == ids
        damage(core, ids[2])
        core.broker.detach_consumer(consumer)  # sent leases stay until expiry
        await core.advance(1001)
        queue = core.broker.queues["q"]
        assert len(queue.leases) == 0
        good = [i for n, i in enumerate(ids) if n != 2]
        assert [ref.id for ref in queue.drr.iter_ready()] == good
        assert all(ref.attempt_count == 1 for ref in queue.drr.iter_ready())
        assert set(set_aside(core)) == {key_of(ids[2])}
        assert core.storage.get(key_of(ids[2])) is None
        assert core.storage.get(keys.lease_key(key_of(ids[2]))) is None
        assert core.broker.quarantine.count == 1

    run(scenario)


def test_a_lease_whose_record_is_gone_ends_without_stopping_its_bucket() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        ids = await core.enqueue("q", 3)
        consumer = core.broker.attach_consumer("q", prefetch=3, max_batch=3)
        await core.settle()
        assert core.take(consumer) == ids
        batch = Batch()
        batch.delete(key_of(ids[0]))
        core.storage.write(batch)
        core.broker.detach_consumer(consumer)
        await core.advance(1001)
        queue = core.broker.queues["q"]
        assert len(queue.leases) == 0
        assert [ref.id for ref in queue.drr.iter_ready()] == ids[1:]

    run(scenario)


def test_a_new_record_is_built_from_the_fields_the_broker_knows() -> None:
    """Whatever reaches the broker, its record holds the id, headers, payload and the
    broker's own metadata and time: fields it does not define are not stored."""

    async def scenario() -> None:
        core = make_core(queues=["q"])
        smuggled = messages_pb2.MessageMetadata(attempt_count=7, throttle_keys=["victim"])
        raw = service_pb2.EnqueueRequest(queue="q", payload=b"p").SerializeToString()
        request = service_pb2.EnqueueRequest.FromString(
            raw
            + b"\x22"
            + bytes([len(smuggled.SerializeToString())])
            + smuggled.SerializeToString()
            + b"\xa2\x06\x01z"
        )
        (result,), committed = core.broker.enqueue([request])
        await committed
        assert isinstance(result, str)
        record = core.storage.get(key_of(result))
        assert record is not None
        message = messages_pb2.Message.FromString(record)
        assert message.metadata.attempt_count == 0 and not message.metadata.throttle_keys
        message.DiscardUnknownFields()
        assert message.ByteSize() == len(record)  # nothing unknown was stored

    run(scenario)


def test_a_stream_nack_of_a_bad_record_sets_it_aside_and_the_stream_settles_on() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        ids = await core.enqueue("q", 3)
        consumer = core.broker.attach_consumer("q", prefetch=3, owns_settlement=True)
        await core.settle()
        assert core.take(consumer) == ids
        damage(core, ids[0])
        core.broker.settle_on_stream(consumer.id, "q", [], [(ids[0], "boom")])
        core.broker.settle_on_stream(consumer.id, "q", ids[1:], [])
        await core.settle()
        queue = core.broker.queues["q"]
        assert len(queue.leases) == 0 and queue.depth == 0
        assert queue.counters.acked == 2
        assert set(set_aside(core)) == {key_of(ids[0])}

    run(scenario)


def test_redrive_sets_a_bad_dead_letter_aside_and_moves_the_rest() -> None:
    async def scenario() -> None:
        core = make_core()
        core.broker.create_queue("q", "", "", 1000, max_attempts=1)  # one failure: the DLQ
        ids = await core.enqueue("q", 3)
        consumer = core.broker.attach_consumer("q", prefetch=3)
        await core.settle()
        core.take(consumer)
        _, committed = core.broker.nack([("q", message_id, "boom") for message_id in ids])
        await committed
        await core.settle()
        dlq = core.broker.queues["q.dlq"]
        assert dlq.depth == 3
        damage(core, ids[1])
        moved = await core.broker.redrive("q.dlq", 0)
        await core.settle()
        assert moved == 2
        assert dlq.depth == 0
        assert set(set_aside(core)) == {key_of(ids[1])}

    run(scenario)


def test_recovery_sets_bad_records_aside_and_starts_with_the_rest() -> None:
    async def scenario() -> None:
        core = make_core(queues=["q"])
        ids = await core.enqueue("q", 4)
        consumer = core.broker.attach_consumer("q", prefetch=1)
        await core.settle()
        (leased,) = core.take(consumer)
        assert leased == ids[0]
        damage(core, ids[0])  # a leased message: its lease record must go too
        other = messages_pb2.Message(id=ids[2]).SerializeToString()
        damage(core, ids[3], other)  # decodes, but names another message
        batch = Batch()
        batch.put(keys.config_key("c"), b"\xff\xfe")
        batch.put(keys.queue_key("broken"), b'{"name": 7}')
        batch.put(keys.delay_key(key_of(ids[1])), b"\x00")
        core.storage.write(batch)

        again, report = restarted(core)
        await again.settle()

        assert report.quarantined == 5
        assert again.broker.quarantine.count == 5
        aside = set(set_aside(again))
        assert aside == {
            key_of(ids[0]),
            key_of(ids[3]),
            keys.config_key("c"),
            keys.queue_key("broken"),
            keys.delay_key(key_of(ids[1])),
        }
        assert again.storage.get(keys.lease_key(key_of(ids[0]))) is None
        queue = again.broker.queues["q"]
        assert [ref.id for ref in queue.drr.iter_ready()] == [ids[1], ids[2]]
        assert "broken" not in again.broker.queues

        third, report = restarted(again)
        assert report.quarantined == 0 and third.broker.quarantine.count == 5

    run(scenario)


def test_a_timer_callback_that_raises_does_not_stop_the_others_or_the_timers() -> None:
    async def scenario() -> None:
        clock = ManualClock()
        timers = Timers(clock, lambda _subject: True)
        ran: list[str] = []

        def boom(_subject: object) -> None:
            raise RuntimeError("a bug")

        now = clock.now_ms()
        timers.at(now, boom, None)
        timers.at(now, ran.append, "same turn")
        timers.at(now + 5, ran.append, "later")
        await until(lambda: ran == ["same turn"], "the entry after the failing one", 5.0)
        assert timers.failures == 1
        clock.advance(5)
        await until(lambda: ran == ["same turn", "later"], "the next entry, re-armed", 5.0)

    run(scenario)


def test_the_edge_keeps_only_the_fields_a_request_defines() -> None:
    """What a handler stores, forwards to another node or echoes is built from parsed
    fields (`fila.server.rpc.parser`), never carried along from the client's bytes."""
    from fila.server import rpc

    clean = service_pb2.EnqueueRequest(queue="q", payload=b"x").SerializeToString()
    parsed = rpc.parser(service_pb2.EnqueueRequest)(clean + UNDECODABLE + b"\xa2\x06\x01z")
    assert isinstance(parsed, service_pb2.EnqueueRequest)
    assert parsed.SerializeToString() == clean
