"""Message life cycle over raw gRPC: create, enqueue, consume, ack, nack, expiry, stats, delete.

Every test runs against a real `fila-server` child process (`server` fixture) and
uses the generated `fila.v1` stubs only: what the wire shows (fields, status codes,
stats). How leases begin and end is specified in-process in tests/core/test_leases.py.
"""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
from support import ServerProcess, wait_until
from support.stubs import Fila, connect, rpc_error, status_of

from fila.v1 import admin_pb2, service_pb2


def _ms(stamp: object) -> int:
    return int(stamp.seconds) * 1000 + int(stamp.nanos) // 1_000_000  # type: ignore[attr-defined]


def _assert_not_found_message(err: grpc.RpcError, queue: str, message_id: str) -> None:
    code, details, kind = status_of(err)
    assert code == grpc.StatusCode.NOT_FOUND, (code, details)
    assert kind == "message_not_found"
    assert message_id in details and queue in details, details


def test_create_queue_also_creates_its_dlq(server: ServerProcess) -> None:
    with connect(server.addr) as f:
        assert f.queue_names() == []
        reply = f.create_queue("orders")
        assert reply.queue_id == "orders"
        listing = f.list_queues()
        assert listing.cluster_node_count == 1
        by_name = {q.name: q for q in listing.queues}
        assert sorted(by_name) == ["orders", "orders.dlq"]
        for info in by_name.values():
            assert (info.depth, info.in_flight, info.active_consumers, info.leader_node_id) == (
                0,
                0,
                0,
                0,
            )
        # The DLQ is an ordinary queue: it has stats of its own.
        assert f.stats("orders.dlq").depth == 0


def test_enqueue_consume_ack_and_message_fields(server: ServerProcess) -> None:
    headers = {"tenant": "acme", "trace": "ünïcode ✓"}
    payload = b"\x00\xff binary \x80 payload"
    with connect(server.addr) as f:
        f.create_queue("jobs")
        before = time.time()
        message_id = f.enqueue("jobs", payload, headers)
        after = time.time()

        parsed = uuid.UUID(message_id)
        assert parsed.version == 7
        assert str(parsed) == message_id  # canonical lower-case 8-4-4-4-12 form
        id_ms = parsed.int >> 80
        assert before * 1000 - 1000 <= id_ms <= after * 1000 + 1000

        stats = f.stats("jobs")
        assert (stats.depth, stats.in_flight, stats.active_consumers) == (1, 0, 0)

        with f.consume("jobs") as stream:
            msg = stream.get()
            assert msg.id == message_id
            assert dict(msg.headers) == headers
            assert msg.payload == payload
            meta = msg.metadata
            assert meta.queue_id == "jobs"
            assert meta.fairness_key == "default"
            assert meta.weight == 1
            assert list(meta.throttle_keys) == []
            assert meta.attempt_count == 0
            assert msg.timestamps.HasField("enqueued_at")
            assert msg.timestamps.HasField("leased_at")
            enqueued_ms = _ms(msg.timestamps.enqueued_at)
            leased_ms = _ms(msg.timestamps.leased_at)
            assert before * 1000 - 1000 <= enqueued_ms <= after * 1000 + 1000
            assert enqueued_ms <= leased_ms <= time.time() * 1000 + 1000

            stats = f.stats("jobs")
            assert (stats.depth, stats.in_flight, stats.active_consumers) == (0, 1, 1)

            f.ack("jobs", message_id)
            stats = f.stats("jobs")
            assert (stats.depth, stats.in_flight) == (0, 0)

            # The ack deleted it: a second ack has nothing to act on.
            _assert_not_found_message(
                rpc_error(f.svc.Ack, service_pb2.AckRequest(queue="jobs", message_id=message_id)),
                "jobs",
                message_id,
            )
            # And the stream's next delivery is a new message, not the acked one.
            marker = f.enqueue("jobs", b"marker")
            assert stream.get().id == marker


def test_ack_or_nack_of_an_expired_lease_is_not_found(server: ServerProcess) -> None:
    with connect(server.addr) as f:
        f.create_queue("expiring", visibility_timeout_ms=300)
        message_id = f.enqueue("expiring", b"x")
        stream = f.consume("expiring")
        assert stream.get().id == message_id
        stream.cancel()  # received, so it stays leased until the timeout

        def expired() -> bool:
            stats = f.stats("expiring")
            return stats.in_flight == 0 and stats.depth == 1

        wait_until(expired, 5.0, what="lease expired back to ready")

        for call, request in (
            (f.svc.Ack, service_pb2.AckRequest(queue="expiring", message_id=message_id)),
            (f.svc.Nack, service_pb2.NackRequest(queue="expiring", message_id=message_id)),
        ):
            _assert_not_found_message(rpc_error(call, request), "expiring", message_id)

        # Neither failed call changed anything; the message is still there, attempt 1.
        with f.consume("expiring") as again:
            msg = again.get()
            assert (msg.id, msg.metadata.attempt_count) == (message_id, 1)
            f.ack("expiring", message_id)


def test_stats_before_and_after_delivery(server: ServerProcess) -> None:
    script = "function on_enqueue(m) return {fairness_key = m.headers.k} end"
    with connect(server.addr) as f:
        f.create_queue("st", on_enqueue=script)
        ids = [f.enqueue("st", b"", {"k": k}) for k in ("a", "a", "b", "a", "b")]

        stats = f.stats("st")
        assert (stats.depth, stats.in_flight, stats.active_consumers) == (5, 0, 0)
        assert stats.active_fairness_keys == 2
        assert stats.quantum >= 1
        assert (stats.leader_node_id, stats.replication_count) == (0, 0)
        per_key = {s.key: (s.pending_count, s.weight) for s in stats.per_key_stats}
        assert per_key == {"a": (3, 1), "b": (2, 1)}
        info = {q.name: q for q in f.list_queues().queues}["st"]
        assert (info.depth, info.in_flight, info.active_consumers) == (5, 0, 0)

        stream = f.consume("st")
        received = stream.take(5)
        assert sorted(m.id for m in received) == sorted(ids)
        stats = f.stats("st")
        assert (stats.depth, stats.in_flight, stats.active_consumers) == (0, 5, 1)
        assert stats.active_fairness_keys == 0
        assert list(stats.per_key_stats) == []
        info = {q.name: q for q in f.list_queues().queues}["st"]
        assert (info.depth, info.in_flight, info.active_consumers) == (0, 5, 1)

        f.ack("st", ids[0])
        f.ack("st", ids[1])
        f.nack("st", ids[2], "again")  # goes back and straight to the open stream
        redelivered = stream.get()
        assert (redelivered.id, redelivered.metadata.attempt_count) == (ids[2], 1)
        stats = f.stats("st")
        assert (stats.depth, stats.in_flight) == (0, 3)

        stream.cancel()
        wait_until(
            lambda: f.stats("st").active_consumers == 0, 5.0, what="consumer count back to 0"
        )
        # A client that went away keeps its received messages leased (until the timeout).
        stats = f.stats("st")
        assert (stats.depth, stats.in_flight) == (0, 3)


def _dead_letter_one(f: Fila, queue: str) -> str:
    """Enqueues a message and nacks it into `<queue>.dlq`; returns its id."""
    message_id = f.enqueue(queue, b"doomed")
    with f.consume(queue) as stream:
        assert stream.get().id == message_id
        f.nack(queue, message_id, "fatal")
    wait_until(lambda: f.stats(queue + ".dlq").depth == 1, 5.0, what="message dead-lettered")
    return message_id


def test_delete_queue_removes_queue_dlq_and_messages(server: ServerProcess) -> None:
    to_dlq = 'function on_failure(m) return {action = "dlq"} end'
    with connect(server.addr) as f:
        f.create_queue("gone", on_failure=to_dlq)
        f.create_queue("kept")
        _dead_letter_one(f, "gone")
        for i in range(3):
            f.enqueue("gone", f"old-{i}".encode())
        stream = f.consume("gone")
        leased = stream.take(3)
        stats = f.stats("gone")
        assert (stats.depth, stats.in_flight) == (0, 3)

        f.delete_queue("gone")

        assert f.queue_names() == ["kept", "kept.dlq"]
        for name in ("gone", "gone.dlq"):
            code, details, kind = status_of(
                rpc_error(f.admin.GetStats, admin_pb2.GetStatsRequest(queue=name))
            )
            assert (code, kind) == (grpc.StatusCode.NOT_FOUND, "queue_not_found")
            assert name in details
        code, _, _ = status_of(
            rpc_error(f.svc.Enqueue, service_pb2.EnqueueRequest(queue="gone", payload=b"x"))
        )
        assert code == grpc.StatusCode.NOT_FOUND
        # The open consume stream ends with NOT_FOUND, and its lease is gone.
        end = stream.ended(5.0)
        assert end.error is not None and end.error.code() == grpc.StatusCode.NOT_FOUND
        code, _, _ = status_of(
            rpc_error(f.svc.Ack, service_pb2.AckRequest(queue="gone", message_id=leased[0].id))
        )
        assert code == grpc.StatusCode.NOT_FOUND

        # Same name again: a fresh, empty queue and DLQ.
        f.create_queue("gone")
        assert f.queue_names() == ["gone", "gone.dlq", "kept", "kept.dlq"]
        for name in ("gone", "gone.dlq"):
            stats = f.stats(name)
            assert (stats.depth, stats.in_flight) == (0, 0), name
            marker = f.enqueue(name, b"new")
            with f.consume(name) as fresh:
                first = fresh.get()
            assert (first.id, first.payload) == (marker, b"new"), name


@pytest.mark.parametrize("persist_mode", ["sync", "buffer"])
def test_lifecycle_in_both_persist_modes(server_factory: object, persist_mode: str) -> None:
    """The plain enqueue -> consume -> ack path is the same in either durability mode."""
    srv = server_factory(persist_mode=persist_mode)  # type: ignore[operator]
    with connect(srv.addr) as f:
        f.create_queue("modes")
        ids = [f.enqueue("modes", str(i).encode()) for i in range(5)]
        with f.consume("modes") as stream:
            got = stream.take(5)
            assert [m.id for m in got] == ids  # one key: FIFO
            for m in got:
                f.ack("modes", m.id)
        stats = f.stats("modes")
        assert (stats.depth, stats.in_flight) == (0, 0)
