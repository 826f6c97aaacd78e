"""Job-queue additions (SPEC 1): delay_ms, ExtendLease, PeekMessages, PurgeQueue and
the GetStats counters, against a real broker, including across kill -9."""

from __future__ import annotations

import time

import grpc
import pytest
from support import ServerFactory, wait_until
from support.stubs import RPC_TIMEOUT_S, Fila, StreamConsumer, connect, rpc_error

from fila.v1 import admin_pb2, messages_pb2, service_pb2

PROMPT_S = 10.0
ON_TIME_MS = 50
TENANT_KEYS = "function on_enqueue(m) return { fairness_key = m.headers.tenant } end"


def _enqueue(fila: Fila, queue: str, payload: bytes, **kw: object) -> str:
    request = service_pb2.EnqueueRequest(queue=queue, payload=payload, **kw)  # type: ignore[arg-type]
    return str(fila.svc.Enqueue(request, timeout=RPC_TIMEOUT_S).message_id)


def _peek(fila: Fila, queue: str, **kw: object) -> admin_pb2.PeekMessagesResponse:
    request = admin_pb2.PeekMessagesRequest(queue=queue, **kw)  # type: ignore[arg-type]
    return fila.admin.PeekMessages(request, timeout=RPC_TIMEOUT_S)


def _purge(fila: Fila, queue: str) -> int:
    reply = fila.admin.PurgeQueue(admin_pb2.PurgeQueueRequest(queue=queue), timeout=RPC_TIMEOUT_S)
    return int(reply.purged)


def _extend(fila: Fila, queue: str, message_id: str, extend_ms: int) -> int:
    request = service_pb2.ExtendLeaseRequest(
        queue=queue, message_id=message_id, extend_ms=extend_ms
    )
    reply = fila.svc.ExtendLease(request, timeout=RPC_TIMEOUT_S)
    return int(reply.deadline.ToMilliseconds())


def test_a_delayed_message_becomes_ready_on_time(server_factory: ServerFactory) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("jobs")
        with fila.consume("jobs") as stream:
            sent = time.time()
            _enqueue(fila, "jobs", b"later", delay_ms=400)
            _enqueue(fila, "jobs", b"now")
            assert stream.get(PROMPT_S).payload == b"now"
            assert fila.stats("jobs").depth == 1  # the delayed one counts in depth
            message = stream.get(PROMPT_S)
            arrived = time.time()
        assert message.payload == b"later"
        # On the broker's clock: leased (delivered) within 50 ms of its due time.
        enqueued = message.timestamps.enqueued_at.ToMilliseconds()
        late_ms = message.timestamps.leased_at.ToMilliseconds() - enqueued - 400
        assert 0 <= late_ms <= ON_TIME_MS, f"delayed message {late_ms} ms off its time"
        assert abs(enqueued - sent * 1000) < 1000
        assert arrived - sent >= 0.4


def test_delayed_messages_survive_kill_9_and_keep_their_due_time(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("jobs")
        due = time.time() + 3.0
        ids = [_enqueue(fila, "jobs", b"%d" % i, delay_ms=3000) for i in range(5)]
    server.kill()
    server.start()
    with connect(server.addr) as fila:
        assert fila.stats("jobs").depth == 5
        with fila.consume("jobs") as stream:
            with pytest.raises(TimeoutError):
                stream.get(max(0.0, due - time.time() - 0.5))  # not before its time
            got = stream.take(5, PROMPT_S, ack=True)
            arrived = time.time()
        assert sorted(m.id for m in got) == sorted(ids)
        assert arrived - due < 1.0


def test_delay_over_the_limit_is_refused(server_factory: ServerFactory) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("jobs")
        err = rpc_error(
            fila.svc.Enqueue,
            service_pb2.EnqueueRequest(queue="jobs", payload=b"x", delay_ms=10**13),
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fila.stats("jobs").depth == 0


def test_an_extension_survives_kill_9(server_factory: ServerFactory) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("long", visibility_timeout_ms=500)
        message_id = _enqueue(fila, "long", b"slow job")
        with fila.consume("long") as stream:
            stream.get(PROMPT_S)
            _extend(fila, "long", message_id, 60_000)
            server.kill()
    server.start()
    with connect(server.addr) as fila:
        stats = fila.stats("long")
        assert (stats.in_flight, stats.depth) == (1, 0)
        with fila.consume("long") as stream, pytest.raises(TimeoutError):
            stream.get(1.5)
        fila.ack("long", message_id)


def test_extend_lease_errors(server_factory: ServerFactory) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        message_id = _enqueue(fila, "q", b"x")
        request = service_pb2.ExtendLeaseRequest(queue="q", message_id=message_id, extend_ms=1000)
        err = rpc_error(fila.svc.ExtendLease, request)  # not leased
        assert err.code() == grpc.StatusCode.NOT_FOUND
        missing = service_pb2.ExtendLeaseRequest(queue="nope", message_id=message_id)
        assert rpc_error(fila.svc.ExtendLease, missing).code() == grpc.StatusCode.NOT_FOUND
        with fila.consume("q") as stream:
            stream.get(PROMPT_S)
            huge = service_pb2.ExtendLeaseRequest(
                queue="q", message_id=message_id, extend_ms=10**12
            )
            assert rpc_error(fila.svc.ExtendLease, huge).code() == grpc.StatusCode.INVALID_ARGUMENT


def _state(fila: Fila, queue: str) -> tuple[int, int, list[tuple[str, int]]]:
    stats = fila.stats(queue)
    pages = _peek(fila, queue, limit=1000)
    return (
        stats.depth,
        stats.in_flight,
        [(m.id, m.metadata.attempt_count) for m in pages.messages],
    )


def test_peek_shows_ready_delayed_and_leased_in_id_order_and_changes_nothing(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q", on_enqueue=TENANT_KEYS)
        ids = [_enqueue(fila, "q", b"%d" % i, headers={"tenant": "ab"[i % 2]}) for i in range(10)]
        ids.append(_enqueue(fila, "q", b"delayed", headers={"tenant": "a"}, delay_ms=60_000))
        with fila.consume("q", read_limit=1) as stream:
            leased = stream.get(PROMPT_S)
            wait_until(lambda: fila.stats("q").in_flight >= 1, PROMPT_S)
            before = _state(fila, "q")
            page = _peek(fila, "q")
            assert [m.id for m in page.messages] == ids[:11]
            by_id = {m.id: m for m in page.messages}
            assert by_id[leased.id].timestamps.HasField("leased_at")
            assert not by_id[ids[-1]].timestamps.HasField("leased_at")
            assert page.next_after_id == ""
            # paging
            first = _peek(fila, "q", limit=4)
            assert [m.id for m in first.messages] == ids[:4]
            assert first.next_after_id == ids[3]
            second = _peek(fila, "q", limit=4, after_id=first.next_after_id)
            assert [m.id for m in second.messages] == ids[4:8]
            last = _peek(fila, "q", limit=4, after_id=second.next_after_id)
            assert [m.id for m in last.messages] == ids[8:11]
            assert last.next_after_id == ""
            # filter by fairness key
            only_b = _peek(fila, "q", fairness_key="b")
            assert [m.id for m in only_b.messages] == ids[1:10:2]
            assert _state(fila, "q") == before  # nothing moved, nothing counted


def test_peek_works_on_a_dlq_without_leasing_so_redrive_moves_everything(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q", on_failure='function on_failure(m) return { action = "dlq" } end')
        ids = [_enqueue(fila, "q", b"%d" % i) for i in range(3)]
        with fila.consume("q") as stream:
            for message in stream.take(3, PROMPT_S):
                fila.nack("q", message.id, "bad")
        wait_until(lambda: fila.stats("q.dlq").depth == 3, PROMPT_S)
        peeked = _peek(fila, "q.dlq")
        assert [m.id for m in peeked.messages] == ids
        assert {m.metadata.queue_id for m in peeked.messages} == {"q.dlq"}
        assert fila.stats("q.dlq").in_flight == 0
        moved = fila.admin.Redrive(
            admin_pb2.RedriveRequest(dlq_queue="q.dlq"), timeout=RPC_TIMEOUT_S
        ).redriven
        assert moved == 3


def test_peek_errors(server_factory: ServerFactory) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        batch = [service_pb2.EnqueueRequest(queue="q", payload=b"%d" % i) for i in range(1001)]
        reply = fila.svc.EnqueueBatch(
            service_pb2.EnqueueBatchRequest(messages=batch), timeout=RPC_TIMEOUT_S
        )
        ids = [r.message_id for r in reply.results]
        missing = rpc_error(fila.admin.PeekMessages, admin_pb2.PeekMessagesRequest(queue="nope"))
        assert missing.code() == grpc.StatusCode.NOT_FOUND
        bad_after = admin_pb2.PeekMessagesRequest(queue="q", after_id="not-an-id")
        assert rpc_error(fila.admin.PeekMessages, bad_after).code() == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        capped = _peek(fila, "q", limit=100_000)  # over 1,000: treated as 1,000, not refused
        assert [m.id for m in capped.messages] == ids[:1000]
        assert capped.next_after_id == ids[999]


def test_purge_deletes_ready_and_delayed_and_leaves_leased_to_finish(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("q")
        for i in range(5):
            _enqueue(fila, "q", b"%d" % i)
        _enqueue(fila, "q", b"delayed", delay_ms=60_000)
        with StreamConsumer(fila.svc, "q", prefetch=2) as stream:
            held = stream.take(2, PROMPT_S)
            assert fila.stats("q").in_flight == 2
            assert _purge(fila, "q") == 4
            stats = fila.stats("q")
            assert (stats.depth, stats.in_flight) == (0, 2)
            for message in held:
                fila.ack("q", message.id)
        assert _purge(fila, "q") == 0
        _enqueue(fila, "q", b"after purge")
        server.kill()
    server.start()
    with connect(server.addr) as fila:
        assert [m.payload for m in _peek(fila, "q").messages] == [b"after purge"]
        missing = rpc_error(fila.admin.PurgeQueue, admin_pb2.PurgeQueueRequest(queue="nope"))
        assert missing.code() == grpc.StatusCode.NOT_FOUND


def test_get_stats_counts_what_happened(server_factory: ServerFactory) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue(
            "q",
            on_enqueue=TENANT_KEYS,
            on_failure='function on_failure(m) if m.attempts >= 2 then return { action = "dlq" } '
            'end return { action = "retry" } end',
        )
        for i in range(6):
            _enqueue(fila, "q", b"%d" % i, headers={"tenant": "ab"[i % 2]})
        with fila.consume("q") as stream:
            got = stream.take(6, PROMPT_S)
            for message in got[:3]:
                fila.ack("q", message.id)
            fila.nack("q", got[3].id, "first")
            again = stream.get(PROMPT_S)
            assert again.id == got[3].id
            fila.nack("q", again.id, "second")  # dead-lettered
            for message in got[4:]:  # these two expire once and come back
                request = service_pb2.ExtendLeaseRequest(
                    queue="q", message_id=message.id, extend_ms=1
                )
                fila.svc.ExtendLease(request, timeout=RPC_TIMEOUT_S)
            back = stream.take(2, PROMPT_S)
            for message in back:
                fila.ack("q", message.id)
        stats = fila.stats("q")
        assert (
            stats.enqueued_total,
            stats.delivered_total,
            stats.acked_total,
            stats.nacked_total,
            stats.expired_total,
            stats.dead_lettered_total,
        ) == (6, 9, 5, 2, 2, 1)
        assert fila.stats("q.dlq").depth == 1
        delivered_by_key = {k.key: k.delivered_total for k in stats.per_key_stats}
        assert delivered_by_key == {}  # no backlog: no active keys listed
        _enqueue(fila, "q", b"x", headers={"tenant": "a"})
        per_key = {k.key: k.delivered_total for k in fila.stats("q").per_key_stats}
        assert per_key == {"a": 4}


def test_peek_returns_stored_messages_exactly(server_factory: ServerFactory) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        message_id = _enqueue(fila, "q", b"\x00payload\xff", headers={"k": "v", "é": "ü"})
        (message,) = _peek(fila, "q").messages
        expected = messages_pb2.Message(id=message_id, headers={"k": "v", "é": "ü"})
        assert (message.id, dict(message.headers), message.payload) == (
            expected.id,
            dict(expected.headers),
            b"\x00payload\xff",
        )
        assert message.metadata.queue_id == "q"
        assert message.metadata.fairness_key == "default"
