"""Streams: what a consumer's stream is handed, in frames, and the byte budgets that
bound what the broker holds for streams that do not read.

docs/semantics.md, Batch paths: a stream that asked for `max_batch > 1` gets frames
of up to that many messages (in `messages`), others one `message` per frame. A
frame's leases are recorded in one write as it is handed to gRPC, and its bytes
count against the stream's `scheduler.stream_buffer_bytes` and the broker's
`scheduler.total_buffer_bytes` until gRPC has written it.
"""

from __future__ import annotations

import asyncio

from support import until
from support.core import CoreBroker, config, make_core, run_async

from fila.v1 import service_pb2


@run_async
async def test_a_stream_that_asked_for_batches_gets_frames_of_up_to_max_batch() -> None:
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 7)
    batched = await core.attach("q", prefetch=10, max_batch=3)
    frames: list[list[str]] = []
    while (frame := core.sending(batched)) is not None:
        core.sent(batched)
        response = service_pb2.ConsumeResponse.FromString(frame)
        assert not response.HasField("message")
        frames.append([m.id for m in response.messages])
    assert frames == [ids[:3], ids[3:6], ids[6:]]
    await core.create_queue("r")
    single = await core.attach("r", prefetch=10)
    (more,) = await core.enqueue("r")
    frame = core.sending(single)
    assert frame is not None
    response = service_pb2.ConsumeResponse.FromString(frame)
    assert (response.message.id, len(response.messages)) == (more, 0)


@run_async
async def test_a_batch_frame_records_its_leases_in_one_write() -> None:
    core = make_core(queues=["q"])
    ids = await core.enqueue("q", 10)
    consumer = await core.attach("q", prefetch=10, max_batch=10)
    writes = core.storage.writes
    assert core.take(consumer) == ids
    assert core.storage.writes == writes + 1  # one WAL append for the frame of ten


@run_async
async def test_a_frame_of_settlements_is_stored_in_one_write() -> None:
    """Every ack and nack of one StreamConsume request (its leases and messages deleted,
    a nacked message rewritten) goes to the WAL in one append."""
    core = make_core(queues=["q"])
    await core.enqueue("q", 6)
    consumer = await core.attach("q", prefetch=6, max_batch=6, stream=True)
    ids = core.take(consumer)
    writes = core.storage.writes
    core.broker.settle_on_stream(
        consumer.id, "q", ids[:5], [(ids[5], "boom")]
    )  # what one request carries
    core.committer.write_now()
    assert core.storage.writes == writes + 1
    assert core.stored_message(ids[0]) is None


@run_async
async def test_settlements_on_a_stream_are_made_durable_without_a_reply() -> None:
    """No one waits on them (SPEC 1: made durable with the next group commit), so they
    start no sync of their own at once: they ride the next one anything asks for, or
    one of their own `SYNC_SOON_S` later."""
    core = make_core(queues=["q"], persist_mode="sync")
    await core.enqueue("q", 2)
    consumer = await core.attach("q", prefetch=2, max_batch=2, stream=True)
    ids = core.take(consumer)
    syncs = core.storage.sync_count
    core.broker.settle_on_stream(consumer.id, "q", ids[:1], [])
    await asyncio.sleep(0)  # the batch is written at the end of the turn
    assert (core.stored_message(ids[0]), core.storage.sync_count) == (None, syncs)
    await until(lambda: core.storage.sync_count > syncs, "a sync of the ack", 10.0)


@run_async
async def test_a_frame_leaves_out_a_delivery_whose_lease_ended_while_it_was_buffered() -> None:
    """A buffered delivery whose lease ended (here it expired unsent, and the message
    was leased again into the same buffer) is not sent; the rest of the frame is."""
    core = make_core(queues=["q"])  # visibility timeout 1000 ms
    first, second = await core.enqueue("q", 2)
    consumer = await core.attach("q", prefetch=3, max_batch=3)
    await core.extend("q", second, 5000)
    await core.advance(1000)  # `first` expires unsent and is buffered again
    assert core.unsettled(consumer) == 2
    assert [m.id for m in core.receive(consumer)] == [second, first]
    assert sorted(core.lease_deadlines("q")) == sorted([first, second])


@run_async
async def test_delivered_counts_the_messages_sent_not_those_only_buffered() -> None:
    core = make_core(queues=["q"])
    await core.enqueue("q", 5)
    consumer = await core.attach("q", prefetch=5, max_batch=2)
    assert core.unsettled(consumer) == 5  # all five leased into the stream's buffer
    assert core.sending(consumer) is not None  # one frame of two
    await core.detach(consumer)  # three go back, never sent
    stats = core.stats("q")
    assert stats.counters.delivered == 2
    assert [(k.key, k.delivered) for k in stats.per_key] == [("default", 2)]
    assert core.latency_samples("q") == 2  # fila.delivery.latency: first deliveries sent


@run_async
async def test_a_frame_counts_against_the_buffer_budget_until_it_is_written() -> None:
    """gRPC holds a frame until the client's window lets it out: its messages stay
    counted, for the stream and the broker, until the write returned (`sent`)."""
    core = make_core(queues=["q"], config=config("[scheduler]\nstream_buffer_bytes = 3000\n"))
    await core.enqueue_requests(
        [service_pb2.EnqueueRequest(queue="q", payload=bytes(1000)) for _ in range(10)]
    )
    consumer = await core.attach("q", prefetch=100, max_batch=100)
    buffered, _ = core.held(consumer)
    assert 3000 <= buffered < 4200 and core.unsettled(consumer) == 3, "the stream is full"
    assert core.sending(consumer, 100) is not None  # handed to gRPC, not written
    await core.settle()
    assert core.held(consumer) == (0, buffered)
    assert core.budget() == (buffered, False), "still the broker's"
    assert core.unsettled(consumer) == 3, "a stream whose frame is not out gets no more"
    core.sent(consumer)
    await core.settle()
    assert core.unsettled(consumer) == 6, "written: room for more"
    buffered, held = core.held(consumer)
    assert held == buffered == core.budget()[0]


async def _budget_spent_by_a_stream_that_never_sends() -> CoreBroker:
    """Queues "a" and "b"; a stream on "a" holds the whole (2 KB) buffer budget."""
    core = make_core(queues=["a", "b"], config=config("[scheduler]\ntotal_buffer_bytes = 2048\n"))
    await core.enqueue_requests(
        [service_pb2.EnqueueRequest(queue="a", payload=bytes(1500)) for _ in range(3)]
    )
    await core.attach("a", prefetch=10)  # a stream that never sends
    assert core.budget()[1], "spent"
    return core


@run_async
async def test_a_stream_that_sends_what_it_gets_is_served_while_unread_ones_spend_the_budget() -> (
    None
):
    core = await _budget_spent_by_a_stream_that_never_sends()
    reading = await core.attach("b", prefetch=10, max_batch=10)
    ids = await core.enqueue("b", 5)
    received: list[str] = []
    for _ in range(10):
        received += core.take(reading)
        await core.settle()
    assert received == ids, "served one message at a time, not stalled"
    assert core.budget()[1], "the unread stream keeps what it holds"


@run_async
async def test_deleting_a_queue_whose_streams_spent_the_buffer_budget_unblocks_the_others() -> None:
    core = await _budget_spent_by_a_stream_that_never_sends()
    waiting = await core.attach("b", prefetch=10, max_batch=10)
    ids = await core.enqueue("b", 2)
    # With the budget spent, a stream holds one unsent message at most.
    assert core.unsettled(waiting) == 1
    await core.delete_queue("a")
    assert not core.budget()[1]
    assert core.unsettled(waiting) == 2, "the budget back, the rest is buffered at once"
    assert core.take(waiting) == ids
