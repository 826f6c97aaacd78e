"""The batch paths of SPEC section 1 against a real broker: EnqueueBatch, AckBatch,
NackBatch, StreamEnqueue, StreamConsume and Consume's max_batch / prefetch.

Per-item results and errors, mixed queues, limits, flow control, and a kill -9 in
the middle of a stream of batches (every answered item survives, no batch is half
stored).
"""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
from support import ServerFactory, wait_until
from support.stubs import RPC_TIMEOUT_S, Fila, StreamConsumer, StreamEnded, connect, rpc_error

from fila.v1 import service_pb2

PROMPT_S = 10.0


def _enq(queue_name: str, payload: bytes = b"x", **kw: object) -> service_pb2.EnqueueRequest:
    return service_pb2.EnqueueRequest(queue=queue_name, payload=payload, **kw)  # type: ignore[arg-type]


def _batch(fila: Fila, items: list[service_pb2.EnqueueRequest]) -> service_pb2.EnqueueBatchResponse:
    return fila.svc.EnqueueBatch(
        service_pb2.EnqueueBatchRequest(messages=items), timeout=RPC_TIMEOUT_S
    )


def test_enqueue_batch_answers_each_item_in_order_and_stores_only_the_good_ones(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(
        config_toml="[server]\nmax_message_bytes = 1000\nmax_headers = 2\nmax_queue_depth = 3\n"
    )
    with connect(server.addr) as fila:
        fila.create_queue("a")
        fila.create_queue("b")
        fila.create_queue("small")
        items = [
            _enq("a", b"a1"),
            _enq("missing"),
            _enq("b", b"b1"),
            _enq("bad name!"),
            _enq("a", bytes(1001)),
            _enq("a", headers={"h1": "1", "h2": "2", "h3": "3"}),
            _enq("a", delay_ms=10**15),
            *[_enq("small", b"s%d" % i) for i in range(4)],
            _enq("b", b"b2"),
        ]
        reply = _batch(fila, items)
        kinds = [
            r.message_id[:0] + "id" if r.WhichOneof("result") == "message_id" else r.error.kind
            for r in reply.results
        ]
        assert kinds == [
            "id",
            "queue_not_found",
            "id",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "invalid_argument",
            "id",
            "id",
            "id",
            "resource_exhausted",
            "id",
        ]
        codes = {r.error.kind: r.error.code for r in reply.results if r.HasField("error")}
        assert codes["queue_not_found"] == grpc.StatusCode.NOT_FOUND.value[0]
        assert codes["resource_exhausted"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        missing = next(r.error for r in reply.results if r.error.kind == "queue_not_found")
        assert missing.message == 'queue "missing" not found'
        assert (fila.stats("a").depth, fila.stats("b").depth, fila.stats("small").depth) == (
            1,
            2,
            3,
        )
        with fila.consume("b") as stream:
            got = [m.payload for m in stream.take(2, PROMPT_S, ack=True)]
        assert got == [b"b1", b"b2"]


def test_whole_batch_refusals(server_factory: ServerFactory) -> None:
    server = server_factory(
        config_toml="[server]\nmax_batch_messages = 5\nmax_message_bytes = 100000\n"
        "max_request_bytes = 240000\n"
    )
    with connect(server.addr) as fila:
        fila.create_queue("q")
        empty = rpc_error(fila.svc.EnqueueBatch, service_pb2.EnqueueBatchRequest())
        assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT
        over = rpc_error(
            fila.svc.EnqueueBatch,
            service_pb2.EnqueueBatchRequest(messages=[_enq("q")] * 6),
        )
        assert over.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 5" in (over.details() or "")
        too_big = rpc_error(
            fila.svc.EnqueueBatch,
            service_pb2.EnqueueBatchRequest(messages=[_enq("q", bytes(90_000))] * 3),
        )
        assert too_big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call, request in (
            (fila.svc.AckBatch, service_pb2.AckBatchRequest()),
            (fila.svc.NackBatch, service_pb2.NackBatchRequest()),
        ):
            assert rpc_error(call, request).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fila.stats("q").depth == 0


def test_ack_and_nack_batches_settle_each_item_on_its_own(server_factory: ServerFactory) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        fila.create_queue("other")
        reply = _batch(fila, [_enq("q", b"%d" % i) for i in range(4)])
        ids = [r.message_id for r in reply.results]
        with fila.consume("q") as stream:
            delivered = stream.take(4, PROMPT_S)
        assert [m.id for m in delivered] == ids
        acks = service_pb2.AckBatchRequest(
            acks=[
                service_pb2.AckRequest(queue="q", message_id=ids[0]),
                service_pb2.AckRequest(queue="q", message_id=ids[0]),  # already acked
                service_pb2.AckRequest(queue="other", message_id=ids[1]),  # wrong queue
                service_pb2.AckRequest(queue="nope", message_id=ids[1]),
                service_pb2.AckRequest(queue="q", message_id="not-an-id"),
                service_pb2.AckRequest(queue="q", message_id=ids[1]),
            ]
        )
        results = fila.svc.AckBatch(acks, timeout=RPC_TIMEOUT_S).results
        assert [r.kind for r in results] == [
            "",
            "message_not_found",
            "message_not_found",
            "queue_not_found",
            "message_not_found",
            "",
        ]
        assert results[0].code == 0
        nacks = service_pb2.NackBatchRequest(
            nacks=[
                service_pb2.NackRequest(queue="q", message_id=ids[2], error="boom"),
                service_pb2.NackRequest(queue="q", message_id=ids[0]),
                service_pb2.NackRequest(queue="q", message_id=ids[3], error="bang"),
            ]
        )
        results = fila.svc.NackBatch(nacks, timeout=RPC_TIMEOUT_S).results
        assert [r.kind for r in results] == ["", "message_not_found", ""]
        stats = fila.stats("q")
        assert (stats.depth, stats.in_flight, stats.acked_total, stats.nacked_total) == (2, 0, 2, 2)
        with fila.consume("q") as stream:
            again = stream.take(2, PROMPT_S)
        assert sorted(m.id for m in again) == sorted(ids[2:])
        assert {m.metadata.attempt_count for m in again} == {1}


def test_stream_enqueue_answers_by_sequence_and_keeps_the_stream_after_bad_items(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        requests = [
            service_pb2.StreamEnqueueRequest(
                sequence_number=seq, messages=[_enq("q", b"%d" % seq), _enq("missing")]
            )
            for seq in range(50)
        ]
        responses = list(fila.svc.StreamEnqueue(iter(requests), timeout=RPC_TIMEOUT_S))
        assert [r.sequence_number for r in responses] == list(range(50))
        for response in responses:
            first, second = response.results
            assert first.WhichOneof("result") == "message_id"
            assert second.error.kind == "queue_not_found"
        assert fila.stats("q").depth == 50
        with fila.consume("q") as stream:
            payloads = [m.payload for m in stream.take(50, PROMPT_S, ack=True)]
        assert payloads == [b"%d" % i for i in range(50)]


def test_stream_enqueue_answers_every_stored_request_before_refusing_an_undecodable_one(
    server_factory: ServerFactory,
) -> None:
    """Requests before the bad frame were stored: each gets its answer, then the status."""
    server = server_factory()
    frames = [
        service_pb2.StreamEnqueueRequest(
            sequence_number=seq, messages=[_enq("q", b"%d" % seq)]
        ).SerializeToString()
        for seq in range(1, 21)
    ]
    with connect(server.addr) as fila, grpc.insecure_channel(server.addr) as channel:
        fila.create_queue("q")
        raw = channel.stream_stream(
            "/fila.v1.FilaService/StreamEnqueue",
            request_serializer=lambda frame: frame,
            response_deserializer=service_pb2.StreamEnqueueResponse.FromString,
        )
        answered: list[int] = []
        with pytest.raises(grpc.RpcError) as ended:
            for response in raw(iter([*frames, b"\xff\xff\xff"]), timeout=RPC_TIMEOUT_S):
                assert [r.WhichOneof("result") for r in response.results] == ["message_id"]
                answered.append(response.sequence_number)
        assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid fila.v1.StreamEnqueueRequest" in (ended.value.details() or "")
        assert answered == list(range(1, 21))
        assert fila.stats("q").depth == 20
    assert "never retrieved" not in server.log_text()


def test_consume_max_batch_sends_messages_in_frames_never_in_message(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        _batch(fila, [_enq("q", b"%d" % i) for i in range(40)])
        call = fila.svc.Consume(service_pb2.ConsumeRequest(queue="q", max_batch=8, prefetch=40))
        seen: list[bytes] = []
        try:
            for frame in call:
                if not frame.messages:
                    continue
                assert not frame.HasField("message")
                assert 1 <= len(frame.messages) <= 8
                seen += [m.payload for m in frame.messages]
                if len(seen) == 40:
                    break
        finally:
            call.cancel()
        assert seen == [b"%d" % i for i in range(40)]


@pytest.mark.parametrize("prefetch", [1, 5])
def test_a_stream_never_holds_more_than_its_prefetch(
    server_factory: ServerFactory, prefetch: int
) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        _batch(fila, [_enq("q", b"%d" % i) for i in range(20)])
        with StreamConsumer(fila.svc, "q", prefetch=prefetch, max_batch=4) as stream:
            first = stream.take(prefetch, PROMPT_S)
            with pytest.raises(TimeoutError):
                stream.get(0.5)  # nothing past the prefetch while nothing is settled
            assert fila.stats("q").in_flight == prefetch
            stream.ack([first[0].id])
            more = stream.get(PROMPT_S)
            assert more.payload == b"%d" % prefetch
            wait_until(lambda: fila.stats("q").acked_total == 1, PROMPT_S)
            assert fila.stats("q").in_flight == prefetch


def test_stream_consume_settles_on_the_stream_and_ends_on_an_unknown_id(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        _batch(fila, [_enq("q", b"%d" % i) for i in range(6)])
        with StreamConsumer(fila.svc, "q", prefetch=10, max_batch=10) as stream:
            got = stream.take(6, PROMPT_S)
            stream.ack([got[0].id, got[1].id])
            stream.nack(got[2].id, "failed")
            retried = stream.get(PROMPT_S)  # no on_failure: retried at once, same stream
            assert (retried.id, retried.metadata.attempt_count) == (got[2].id, 1)
            assert fila.stats("q").acked_total == 2
            stream.ack(["00000000-0000-7000-8000-000000000000"])
            end = stream.ended(PROMPT_S)
        assert end.error is not None and end.error.code() == grpc.StatusCode.NOT_FOUND
        assert "00000000-0000-7000-8000-000000000000" in (end.error.details() or "")
        # The stream's four unsettled messages are ready again, each a failed attempt.
        wait_until(lambda: fila.stats("q").in_flight == 0, PROMPT_S)
        stats = fila.stats("q")
        assert (stats.depth, stats.acked_total, stats.nacked_total) == (4, 2, 1)
        with fila.consume("q") as plain:
            again = plain.take(4, PROMPT_S)
        attempts = {m.payload: m.metadata.attempt_count for m in again}
        assert attempts == {b"2": 2, b"3": 1, b"4": 1, b"5": 1}


def test_a_message_leased_on_one_stream_cannot_be_acked_on_another(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        _batch(fila, [_enq("q", b"a"), _enq("q", b"b")])
        with StreamConsumer(fila.svc, "q", prefetch=1) as first:
            message = first.get(PROMPT_S)
            with StreamConsumer(fila.svc, "q", prefetch=1) as second:
                second.get(PROMPT_S)
                second.ack([message.id])
                end = second.ended(PROMPT_S)
            assert end.error is not None and end.error.code() == grpc.StatusCode.NOT_FOUND
            first.ack([message.id])
            wait_until(lambda: fila.stats("q").acked_total == 1, PROMPT_S)


SENDERS = 4


def _batch_sender(
    addr: str, first: int, stop: threading.Event, answered: queue.Queue[tuple[int, list[str]]]
) -> None:
    """Sends 20-message batches tagged `batch:item` until stopped or the broker dies."""
    with connect(addr) as fila:
        batch_no = first
        while not stop.is_set():
            items = [_enq("crash", b"%d:%d" % (batch_no, i)) for i in range(20)]
            try:
                reply = _batch(fila, items)
            except grpc.RpcError:
                return
            answered.put((batch_no, [r.message_id for r in reply.results]))
            batch_no += SENDERS


def test_kill_9_during_batches_keeps_every_answered_item_and_no_half_batch(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("crash")
    stop = threading.Event()
    answered: queue.Queue[tuple[int, list[str]]] = queue.Queue()
    senders = [
        threading.Thread(target=_batch_sender, args=(server.addr, first, stop, answered))
        for first in range(SENDERS)
    ]
    for sender in senders:
        sender.start()
    wait_until(lambda: answered.qsize() >= 20, PROMPT_S, what="20 answered batches")
    server.kill()
    stop.set()
    for sender in senders:
        sender.join(PROMPT_S)
    server.start()
    acknowledged: set[str] = set()
    while not answered.empty():
        acknowledged.update(answered.get()[1])
    with connect(server.addr) as fila:
        depth = fila.stats("crash").depth
        with fila.consume("crash") as stream:
            stored = stream.take(depth, PROMPT_S * 3, ack=True)
    stored_ids = {m.id for m in stored}
    missing = set(acknowledged) - stored_ids
    assert not missing, f"{len(missing)} answered messages lost"
    by_batch: dict[bytes, set[bytes]] = {}
    for message in stored:
        batch_tag, item = message.payload.split(b":")
        by_batch.setdefault(batch_tag, set()).add(item)
    partial = {tag: len(items) for tag, items in by_batch.items() if len(items) != 20}
    assert not partial, f"batches stored in part: {partial}"


def test_a_stream_ended_by_an_unknown_id_returns_its_unsent_messages_at_once(
    server_factory: ServerFactory,
) -> None:
    """Messages queued for a stream but never written (its client stopped reading)
    must go back when the stream ends, not sit leased until the visibility timeout."""
    server = server_factory(
        persist_mode="buffer",
        config_toml="[scheduler]\nstream_buffer_bytes = 100000000\n"
        "total_buffer_bytes = 100000000\n",
    )
    with connect(server.addr) as fila:
        fila.create_queue("q")
        for _ in range(4):
            _batch(fila, [_enq("q", bytes(200_000))] * 50)
        stream = StreamConsumer(fila.svc, "q", prefetch=200, max_batch=1, read=False)
        try:
            wait_until(lambda: fila.stats("q").in_flight == 200, PROMPT_S)
            stream.ack(["00000000-0000-7000-8000-000000000000"])
            stream.allow_reading()
            end = _read_until_end(stream, PROMPT_S * 3)
            assert end.error is not None and end.error.code() == grpc.StatusCode.NOT_FOUND
            wait_until(lambda: fila.stats("q").in_flight == 0, 5.0, what="all 200 returned")
            assert fila.stats("q").depth == 200
        finally:
            stream.cancel()


def _read_until_end(stream: StreamConsumer, within: float) -> StreamEnded:
    """Reads (and drops) whatever was already sent until the stream ends."""
    deadline = time.monotonic() + within
    while True:
        try:
            stream.get(max(0.0, deadline - time.monotonic()))
        except StreamEnded as end:
            return end


def test_a_graceful_restart_keeps_stream_consume_deliveries_leased_for_settling(
    server_factory: ServerFactory,
) -> None:
    """A client whose StreamConsume ended because the broker stopped may still settle
    what it was handling, with AckBatch, once the broker is back."""
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("q")
        _batch(fila, [_enq("q", b"%d" % i) for i in range(8)])
        stream = StreamConsumer(fila.svc, "q", prefetch=5, max_batch=5)
        try:
            held = stream.take(5, PROMPT_S)
            server.stop()
        finally:
            stream.cancel()
    server.start()
    with connect(server.addr) as fila:
        stats = fila.stats("q")
        assert (stats.depth, stats.in_flight) == (3, 5)
        acks = service_pb2.AckBatchRequest(
            acks=[service_pb2.AckRequest(queue="q", message_id=m.id) for m in held]
        )
        results = fila.svc.AckBatch(acks, timeout=RPC_TIMEOUT_S).results
        assert [r.code for r in results] == [0] * 5
        assert fila.stats("q").in_flight == 0
