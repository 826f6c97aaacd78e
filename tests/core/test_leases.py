"""Leases: how a delivery begins and every way it ends (ack, nack, extend, expiry, the
stream's end), and the bounds on what one consumer holds (prefetch).

SPEC 2: a delivery leases the message for the queue's visibility timeout; Ack deletes
it; Nack counts an attempt and (without `on_failure`, on a queue whose retry backoff
is "none", as `CoreBroker.create_queue` makes them) makes it ready again at once;
a lease neither acked nor nacked in time expires, counting an attempt; acking or
nacking an id that is not leased is NOT_FOUND. docs/semantics.md: ExtendLease sets
the deadline to now + extend_ms; an expiry does not run `on_failure`; a Consume
stream that ends gives back what it never sent at once, a StreamConsume stream also
what it sent (as a failed attempt).
"""

from __future__ import annotations

import pytest
from support.core import config, make_core, run_async

from fila.core import settlement
from fila.core.errors import InvalidArgument, MessageNotFound, QueueNotFound, Unavailable
from fila.storage import keys
from fila.storage.backend import StorageError
from fila.v1 import service_pb2

MISSING_ID = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"


# -- a delivery ----------------------------------------------------------------------------


@run_async
async def test_a_delivery_leases_the_message_until_the_queues_visibility_timeout() -> None:
    core = make_core()
    await core.create_queue("q", visibility_timeout_ms=2500)
    await core.create_queue("default")
    (message_id,) = await core.enqueue("q")
    (other,) = await core.enqueue("default")
    consumer = await core.attach("q")
    (message,) = core.receive(consumer)
    assert (message.id, message.metadata.attempt_count) == (message_id, 0)
    assert message.timestamps.leased_at.ToMilliseconds() == core.now_ms()
    assert core.lease_deadlines("q") == {message_id: core.now_ms() + 2500}
    assert core.depth("q") == (0, 1)
    assert core.take(await core.attach("default")) == [other]
    assert core.lease_deadlines("default") == {other: core.now_ms() + 30_000}


@run_async
async def test_a_lease_record_is_stored_when_the_message_is_sent_not_when_it_is_buffered() -> None:
    core = make_core(queues=["q"])
    await core.enqueue("q", 2)
    consumer = await core.attach("q", prefetch=2, max_batch=1)
    assert core.unsettled(consumer) == 2 and core.stored(keys.LEASE) == []
    assert core.sending(consumer) is not None
    assert len(core.stored(keys.LEASE)) == 1, "the one in the frame handed to gRPC"
    core.sent(consumer)
    assert core.sending(consumer) is not None
    assert len(core.stored(keys.LEASE)) == 2


# -- ack --------------------------------------------------------------------------------------


@run_async
async def test_an_ack_ends_the_lease_and_deletes_the_message_and_its_lease_record() -> None:
    core = make_core(queues=["q"])
    (message_id,) = await core.enqueue("q")
    consumer = await core.attach("q")
    core.take(consumer)
    assert core.stored_message(message_id) is not None and len(core.stored(keys.LEASE)) == 1
    assert await core.ack("q", message_id) == [None]
    assert core.stored_message(message_id) is None and core.stored(keys.LEASE) == []
    assert core.unsettled(consumer) == 0
    assert core.depth("q") == (0, 0)
    assert core.stats("q").counters.acked == 1


@run_async
async def test_an_ack_of_an_id_that_is_not_leased_is_message_not_found_and_changes_nothing() -> (
    None
):
    core = make_core(queues=["q"])
    ready, leased = await core.enqueue("q", 2)
    consumer = await core.attach("q", prefetch=1)
    assert core.take(consumer) == [ready]
    results = await core.ack("q", leased, MISSING_ID, "not-an-id", ready, ready)
    assert [type(r) for r in results] == [
        MessageNotFound,  # ready, not leased
        MessageNotFound,
        MessageNotFound,
        type(None),
        MessageNotFound,  # the second ack of the same id
    ]
    assert isinstance((await core.ack("nope", ready))[0], QueueNotFound)
    assert core.depth("q") == (0, 1), "the ready one was leased once there was room"
    assert core.attempts("q") == {leased: 0}


# -- nack -------------------------------------------------------------------------------------


@run_async
async def test_a_nack_with_no_backoff_makes_the_message_ready_at_once_with_one_more_attempt() -> (
    None
):
    core = make_core(queues=["q"])
    (message_id,) = await core.enqueue("q", headers={"h": "v"})
    consumer = await core.attach("q")
    first = core.receive(consumer)
    for attempt in (1, 2):
        assert await core.nack("q", message_id, error=f"boom {attempt}") == [None]
        (again,) = core.receive(consumer)
        assert (again.id, again.metadata.attempt_count) == (message_id, attempt)
        assert dict(again.headers) == {"h": "v"} and again.payload == first[0].payload
        assert again.timestamps.enqueued_at == first[0].timestamps.enqueued_at
    assert core.stats("q").counters.nacked == 2
    assert core.depth("q.dlq") == (0, 0)


@run_async
async def test_a_nacks_error_is_kept_whole_up_to_4_kib_and_cut_on_a_character_past_it() -> None:
    core = make_core(queues=["q"])
    e_acute = "\u00e9"  # two bytes in UTF-8
    errors = ["e" * 4096, "x" + e_acute * 3000, "xy" + e_acute * 3000]
    ids = await core.enqueue("q", 3)
    consumer = await core.attach("q", prefetch=3, max_batch=3)
    assert core.take(consumer) == ids
    for message_id, error in zip(ids, errors, strict=True):
        await core.nack("q", message_id, error=error)
    kept = {m.id: m.metadata.last_error for m in core.peek("q")[0]}
    # 4,056 bytes kept (the limit less 40 for the note), a character cut in two dropped
    assert kept == {
        ids[0]: errors[0],
        ids[1]: "x" + e_acute * 2027 + "... [truncated, 6001 bytes in all]",
        ids[2]: "xy" + e_acute * 2027 + "... [truncated, 6002 bytes in all]",
    }


@run_async
async def test_a_nack_of_an_id_that_is_not_leased_is_message_not_found_and_changes_nothing() -> (
    None
):
    core = make_core(queues=["q"])
    (message_id,) = await core.enqueue("q")
    results = await core.nack("q", message_id, MISSING_ID)
    assert all(isinstance(r, MessageNotFound) for r in results)
    assert core.attempts("q") == {message_id: 0}
    assert core.stats("q").counters.nacked == 0


# -- expiry -----------------------------------------------------------------------------------


@run_async
async def test_a_lease_expires_at_its_deadline_and_the_message_comes_back_one_attempt_more() -> (
    None
):
    core = make_core(queues=["q"])  # visibility timeout 1000 ms
    (message_id,) = await core.enqueue("q")
    consumer = await core.attach("q")
    assert core.take(consumer) == [message_id]
    await core.advance(999)
    assert core.depth("q") == (0, 1)
    await core.advance(1)
    # expired: ready again with attempt 1, and delivered again to the consumer
    (again,) = core.receive(consumer)
    assert (again.id, again.metadata.attempt_count) == (message_id, 1)
    assert core.stats("q").counters.expired == 1
    assert core.lease_deadlines("q") == {message_id: core.now_ms() + 1000}


@run_async
async def test_an_ack_or_nack_after_the_lease_expired_is_message_not_found() -> None:
    core = make_core(queues=["q"])
    (message_id,) = await core.enqueue("q")
    consumer = await core.attach("q")
    core.take(consumer)
    await core.detach(consumer)  # received: it stays leased until its deadline
    assert core.depth("q") == (0, 1)
    await core.advance(1000)
    assert core.depth("q") == (1, 0)
    assert isinstance((await core.ack("q", message_id))[0], MessageNotFound)
    assert isinstance((await core.nack("q", message_id))[0], MessageNotFound)
    assert core.attempts("q") == {message_id: 1}, "neither call changed anything"


@run_async
async def test_leases_granted_in_the_same_millisecond_expire_together_and_others_do_not() -> None:
    core = make_core(queues=["q"])
    early = await core.enqueue("q", 3)
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    assert core.take(consumer) == early
    await core.advance(400)
    late = await core.enqueue("q", 2)
    assert core.take(consumer) == late
    await core.advance(600)
    assert sorted(core.attempts("q").items()) == sorted(
        [(m, 1) for m in early] + [(m, 0) for m in late]
    )
    assert sorted(core.lease_deadlines("q")) == sorted(early + late), "all leased again"
    await core.ack("q", *late)
    await core.advance(400)
    assert core.stats("q").counters.expired == 3, "acked leases do not expire"


# -- extend -----------------------------------------------------------------------------------


@run_async
async def test_an_extended_lease_is_not_redelivered_at_the_visibility_timeout() -> None:
    core = make_core(queues=["q"])
    (message_id,) = await core.enqueue("q")
    consumer = await core.attach("q")
    core.take(consumer)
    await core.advance(900)
    assert await core.extend("q", message_id, 5000) == core.now_ms() + 5000
    await core.advance(4999)
    assert core.take(consumer) == [] and core.depth("q") == (0, 1)
    await core.advance(1)
    assert core.take(consumer) == [message_id]
    assert core.attempts("q") == {message_id: 1}


@run_async
async def test_extending_by_0_sets_the_deadline_a_visibility_timeout_from_now() -> None:
    core = make_core()
    await core.create_queue("q", visibility_timeout_ms=3000)
    (message_id,) = await core.enqueue("q")
    core.take(await core.attach("q"))
    await core.advance(2000)
    assert await core.extend("q", message_id, 0) == core.now_ms() + 3000
    assert core.lease_deadlines("q") == {message_id: core.now_ms() + 3000}


@run_async
async def test_extend_refuses_an_id_not_leased_and_a_time_over_the_limit_and_changes_nothing() -> (
    None
):
    core = make_core(queues=["q"])
    leased, ready = await core.enqueue("q", 2)
    core.take(await core.attach("q", prefetch=1))
    deadlines = core.lease_deadlines("q")
    for message_id in (ready, MISSING_ID, "not-an-id"):
        with pytest.raises(MessageNotFound):
            await core.extend("q", message_id, 1000)
    with pytest.raises(InvalidArgument, match="over the limit"):
        await core.extend("q", leased, 7 * 24 * 3600 * 1000 + 1)
    with pytest.raises(QueueNotFound):
        await core.extend("nope", leased, 1000)
    assert core.lease_deadlines("q") == deadlines
    limit = 7 * 24 * 3600 * 1000
    assert await core.extend("q", leased, limit) == core.now_ms() + limit, "the limit is allowed"


# -- the stream's end ---------------------------------------------------------------------


@run_async
async def test_a_consume_stream_that_ends_gives_back_what_it_never_sent_and_keeps_the_rest() -> (
    None
):
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 5)
    consumer = await core.attach("q", prefetch=5, max_batch=2)
    assert core.unsettled(consumer) == 5, "all five leased into its buffer"
    assert core.sending(consumer) is not None  # a frame of two goes out
    core.sent(consumer)
    await core.detach(consumer)
    assert core.depth("q") == (3, 2), "the three it never sent are ready at once"
    assert core.attempts("q") == dict.fromkeys(ids, 0)
    await core.advance(999)
    assert core.depth("q") == (3, 2), "the two it was sent stay leased until their deadline"
    await core.advance(1)
    assert core.depth("q") == (5, 0)
    assert core.attempts("q") == {m: int(m in ids[:2]) for m in ids}


@run_async
async def test_a_stream_consume_stream_settles_only_what_it_was_sent() -> None:
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 4)
    mine = await core.attach("q", prefetch=2, max_batch=2, stream=True)
    other = await core.attach("q", prefetch=2, max_batch=2, stream=True)
    got = core.take(mine)
    theirs = core.take(other)
    assert sorted(got + theirs) == ids
    await core.settle_on_stream(mine, acks=[got[0]], nacks=[(got[1], "boom")])
    assert core.stats("q").counters.acked == 1 and core.stats("q").counters.nacked == 1
    assert core.attempts("q")[got[1]] == 1
    with pytest.raises(MessageNotFound):
        await core.settle_on_stream(mine, acks=[theirs[0]])
    with pytest.raises(MessageNotFound):
        await core.settle_on_stream(mine, acks=[got[0]])  # already acked
    await core.detach(mine)
    with pytest.raises(Unavailable, match=r"^consumer closed$"):
        await core.settle_on_stream(mine, acks=[got[1]])
    with pytest.raises(Unavailable, match=r"^consumer closed$"):
        core.sending(mine)  # its stream is closed: nothing more goes out on it


@run_async
async def test_a_message_given_back_unsent_goes_to_a_waiting_consumer_at_once() -> None:
    """Given back by its stream's end or by its lease's expiry while still buffered,
    a message is ready at once: a consumer with room gets it with nothing else
    happening, and no attempt is counted."""
    core = make_core(queues=["q"])
    first, second = await core.enqueue("q", 2)
    stalled = await core.attach("q", prefetch=1)  # buffers `first`, never reads it
    other = await core.attach("q", prefetch=1)  # buffers `second`
    assert core.take(other) == [second]
    await core.ack("q", second)
    await core.detach(stalled)
    assert core.take(other) == [first]
    await core.detach(other)  # sent: stays leased until it expires
    await core.advance(1000)
    reader = await core.attach("q", prefetch=1)
    assert core.take(reader) == [first] and core.attempts("q") == {first: 1}
    await core.ack("q", first)
    await core.detach(reader)

    (third,) = await core.enqueue("q")
    stalled = await core.attach("q", prefetch=1)  # buffers it, never reads it
    waiting = await core.attach("q", prefetch=1)
    await core.advance(1000)  # its lease expires unsent: delivered again, no attempt
    assert core.take(stalled) + core.take(waiting) == [third]
    assert core.attempts("q") == {third: 0}
    await core.detach(waiting)
    await core.ack("q", third)

    (fourth,) = await core.enqueue("q")  # the stalled stream's only: leased to it again,
    await core.advance(1000)  # so its buffer holds the ended lease and the new one
    await core.detach(stalled)
    assert core.depth("q") == (1, 0) and core.attempts("q") == {fourth: 0}


@run_async
async def test_at_shutdown_streams_end_with_the_reason_and_what_they_sent_stays_leased() -> None:
    """docs/semantics.md: a broker shutting down ends every stream; what a stream
    never sent is ready at once, and what it sent stays leased, a StreamConsume
    stream's too, so its client can still settle it after the restart."""
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 4)
    plain = await core.attach("q", prefetch=2)
    settling = await core.attach("q", prefetch=2, stream=True)
    sent = []
    for consumer in (plain, settling):  # one of its two goes out
        frame = core.sending(consumer, 1)
        assert frame is not None
        sent.append(service_pb2.ConsumeResponse.FromString(frame).message.id)
        core.sent(consumer)
    await core.end_streams(Unavailable("broker is shutting down"))
    for consumer in (plain, settling):
        with pytest.raises(Unavailable, match="shutting down"):
            core.sending(consumer)
    assert core.depth("q") == (2, 2)
    assert sorted(core.lease_deadlines("q")) == sorted(sent)
    assert core.attempts("q") == dict.fromkeys(ids, 0)
    assert len(core.stored(keys.LEASE)) == 2


@run_async
async def test_a_lease_that_cannot_expire_does_not_strand_the_others_due_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lease whose expiry fails (here its record cannot be read) stays as it was;
    the other leases of its millisecond still expire, and it is tried again
    EXPIRY_RETRY_MS later (its timer entry is spent, so without that it stayed leased
    for good)."""
    core = make_core(queues=["q"])
    broken, fine = await core.enqueue("q", 2)
    consumer = await core.attach("q", prefetch=2, max_batch=2)
    assert core.take(consumer) == [broken, fine]
    await core.detach(consumer)
    broken_key = keys.MESSAGE + bytes.fromhex(broken.replace("-", ""))
    get = core.storage.get

    def failing_get(key: bytes) -> bytes | None:
        if key == broken_key:
            raise StorageError("checksum mismatch")
        return get(key)

    monkeypatch.setattr(core.storage, "get", failing_get)
    await core.advance(1000)
    retry_at = core.now_ms() + settlement.EXPIRY_RETRY_MS
    assert core.lease_deadlines("q") == {broken: retry_at}
    assert core.depth("q") == (1, 1) and core.stats("q").counters.expired == 1
    monkeypatch.undo()
    assert core.attempts("q") == {broken: 0, fine: 1}
    await core.advance(settlement.EXPIRY_RETRY_MS - 1)
    assert core.lease_deadlines("q") == {broken: retry_at}
    await core.advance(1)
    assert core.lease_deadlines("q") == {}
    assert core.stats("q").counters.expired == 2
    assert core.attempts("q") == {broken: 1, fine: 1}


# -- what one consumer holds ----------------------------------------------------------------


@run_async
async def test_prefetch_bounds_the_messages_a_consumer_holds_and_an_ack_makes_room() -> None:
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 10)
    consumer = await core.attach("q", prefetch=3, max_batch=10)
    assert core.take(consumer) == ids[:3]
    assert core.take(consumer) == []
    await core.ack("q", ids[0])
    assert core.take(consumer) == ids[3:4]
    await core.nack("q", ids[1])
    assert core.take(consumer) == ids[1:2], "a nack makes room as well"


@run_async
async def test_a_prefetch_of_0_is_the_configured_consumer_buffer() -> None:
    core = make_core(config=config("[scheduler]\nconsumer_buffer = 4\n"), queues=["q"])
    ids = await core.enqueue("q", 10)
    consumer = await core.attach("q", max_batch=10)
    assert core.take(consumer) == ids[:4]
    assert core.depth("q") == (6, 4)


@run_async
async def test_the_consumers_of_a_queue_take_turns_and_each_message_goes_to_one_of_them() -> None:
    core = make_core(queues=["q"])
    consumers = [await core.attach("q", prefetch=100, max_batch=100) for _ in range(3)]
    ids = await core.enqueue("q", 90)
    got = [core.take(consumer) for consumer in consumers]
    assert [len(g) for g in got] == [30, 30, 30]
    assert sorted(m for g in got for m in g) == ids
    assert got[0][:2] == [ids[0], ids[3]], "one each in turn"


@run_async
async def test_a_consumer_that_stops_reading_holds_its_prefetch_and_the_others_get_the_rest() -> (
    None
):
    core = make_core(queues=["q"])
    stalled = await core.attach("q", prefetch=5, max_batch=1)
    reading = await core.attach("q", prefetch=5, max_batch=5)
    ids = await core.enqueue("q", 100)
    got: list[str] = []
    while frame := core.take(reading):
        got += frame
        await core.ack("q", *frame)
    assert len(got) == 95 and core.unsettled(stalled) == 5
    assert sorted(got) == sorted(set(ids) - set(core.lease_deadlines("q")))
