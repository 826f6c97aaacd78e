"""Failure policy end to end: dead-lettering through a real broker (the message's fields
over the wire) and Redrive's status codes.

What the hooks see and decide, retry delays, the breaker, `fila.get` and redrive are
specified in-process: tests/core/test_policy.py, test_delays.py and test_redrive.py.
"""

from __future__ import annotations

import grpc
from support import wait_until
from support.stubs import Fila, connect, rpc_error
from support.timing import TimedConsumer

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, service_pb2

T = 10.0

DLQ_AFTER_3 = """
function on_failure(m)
  if m.attempts >= 3 then return { action = "dlq" } end
  return { action = "retry" }
end
"""

TENANT_KEYS = """
function on_enqueue(m)
  return {
    fairness_key = m.headers.tenant or "none",
    weight = tonumber(m.headers.weight or "1"),
    throttle_keys = { m.headers.throttle },
  }
end
"""

ALWAYS_DLQ = """
function on_failure(m)
  return { action = "dlq" }
end
"""


def set_config(fila: Fila, key: str, value: str) -> None:
    fila.admin.SetConfig(admin_pb2.SetConfigRequest(key=key, value=value), timeout=T)


def redrive(fila: Fila, dlq: str, count: int) -> int:
    reply = fila.admin.Redrive(admin_pb2.RedriveRequest(dlq_queue=dlq, count=count), timeout=T)
    return int(reply.redriven)


def depth(fila: Fila, name: str) -> tuple[int, int]:
    stats = fila.stats(name)
    return stats.depth, stats.in_flight


def wait_depth(fila: Fila, name: str, want: tuple[int, int], timeout: float = 5.0) -> None:
    wait_until(
        lambda: depth(fila, name) == want, timeout, what=f"{name} (depth, in_flight) == {want}"
    )


# ----------------------------------------------------------------- retry delays


# --------------------------------------------------------------- dead-lettering


def test_dead_letter_after_three_attempts_keeps_message(server: ServerProcess) -> None:
    with connect(server.addr) as fila:
        fila.create_queue("orders", on_enqueue=TENANT_KEYS, on_failure=DLQ_AFTER_3)
        headers = {"tenant": "acme", "weight": "3", "throttle": "orders-tk", "trace": "abc"}
        payload = bytes(range(256)) * 4
        message_id = fila.enqueue("orders", payload, headers)
        with TimedConsumer(fila.channel, "orders") as consumer:
            for attempt in range(3):
                _, message = consumer.get(T)
                assert message.id == message_id
                assert message.metadata.attempt_count == attempt
                fila.nack("orders", message_id, "boom")
            # after the third failure the message is no longer in the source queue
            assert depth(fila, "orders") == (0, 0)
            wait_depth(fila, "orders.dlq", (1, 0))
            listed = {q.name: q.depth for q in fila.list_queues().queues}
            assert listed["orders.dlq"] == 1 and listed["orders"] == 0
            # ... and it is not delivered again from the source queue
            err = rpc_error(
                fila.svc.Ack, service_pb2.AckRequest(queue="orders", message_id=message_id)
            )
            assert err.code() == grpc.StatusCode.NOT_FOUND

        with TimedConsumer(fila.channel, "orders.dlq") as dlq_consumer:
            _, dead = dlq_consumer.get(T)
        assert dead.id == message_id
        assert dict(dead.headers) == headers
        assert dead.payload == payload
        meta = dead.metadata
        assert meta.attempt_count == 3
        assert meta.queue_id == "orders.dlq"
        assert meta.fairness_key == "acme"
        assert meta.weight == 3
        assert list(meta.throttle_keys) == ["orders-tk"]
        assert dead.timestamps.enqueued_at.seconds > 0
        assert dead.timestamps.leased_at.seconds > 0
        # DLQ messages are consumed like any other: ack removes it
        fila.ack("orders.dlq", message_id)
        assert depth(fila, "orders.dlq") == (0, 0)


# ----------------------------------------------------------------------- redrive


def dead_letter_all(fila: Fila, queue: str, ids: list[str], *, already_leased: int = 0) -> None:
    """Consumes and nacks every id once (the queue's on_failure dead-letters)."""
    with TimedConsumer(fila.channel, queue) as consumer:
        seen: set[str] = set()
        while len(seen) < len(ids):
            _, message = consumer.get(T)
            assert message.id in ids
            seen.add(message.id)
            fila.nack(queue, message.id, "fatal")
    wait_depth(fila, queue + ".dlq", (len(ids), already_leased))


def test_redrive_errors(server: ServerProcess) -> None:
    with connect(server.addr) as fila:
        fila.create_queue("src", on_failure=ALWAYS_DLQ)
        mid = fila.enqueue("src", b"x")
        dead_letter_all(fila, "src", [mid])
        fila.enqueue("src", b"y")  # something ready in the source queue too

        err = rpc_error(fila.admin.Redrive, admin_pb2.RedriveRequest(dlq_queue="src", count=0))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "src" in (err.details() or "")
        for missing in ("nope", "nope.dlq"):
            err = rpc_error(
                fila.admin.Redrive, admin_pb2.RedriveRequest(dlq_queue=missing, count=0)
            )
            assert err.code() == grpc.StatusCode.NOT_FOUND, missing
            assert missing in (err.details() or "")
        err = rpc_error(fila.admin.Redrive, admin_pb2.RedriveRequest(dlq_queue="", count=0))
        assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
        # the bad requests changed nothing
        assert depth(fila, "src") == (1, 0)
        assert depth(fila, "src.dlq") == (1, 0)


# ------------------------------------------------------------------ fila.get
