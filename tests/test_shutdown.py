"""A graceful stop (SIGTERM) ends every open stream at once, with a status that says
to try again, instead of waiting out `server.shutdown_grace_ms`."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
from support import ServerFactory
from support.stubs import connect

from fila.v1 import service_pb2, service_pb2_grpc

# far longer than the stop may take, so waiting it out cannot pass
GRACE = "[server]\nshutdown_grace_ms = 60000\n"
STOP_DEADLINE_S = 10.0


def test_sigterm_ends_an_idle_stream_enqueue_at_once_with_unavailable(
    server_factory: ServerFactory,
) -> None:
    """The SDK keeps a StreamEnqueue open between enqueues; before, one idle producer
    held the stop for the whole grace period and then saw CANCELLED."""
    server = server_factory(config_toml=GRACE)
    with connect(server.addr) as fila:
        fila.create_queue("orders")
    requests: queue.Queue[service_pb2.StreamEnqueueRequest | None] = queue.Queue()

    def request_stream() -> Iterator[service_pb2.StreamEnqueueRequest]:
        while (request := requests.get()) is not None:
            yield request

    with grpc.insecure_channel(server.addr) as channel:
        call = service_pb2_grpc.FilaServiceStub(channel).StreamEnqueue(request_stream())
        stream = iter(call)
        requests.put(
            service_pb2.StreamEnqueueRequest(
                sequence_number=1,
                messages=[service_pb2.EnqueueRequest(queue="orders", payload=b"kept")],
            )
        )
        answer = next(stream)
        assert answer.sequence_number == 1
        assert answer.results[0].WhichOneof("result") == "message_id"

        ended: list[grpc.RpcError] = []

        def read_to_the_end() -> None:
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as exc:
                ended.append(exc)

        reader = threading.Thread(target=read_to_the_end)
        reader.start()
        started = time.monotonic()
        assert server.stop(timeout=STOP_DEADLINE_S) == 0  # raises if it waited the grace
        stopped_s = time.monotonic() - started
        reader.join(STOP_DEADLINE_S)
        requests.put(None)

    assert ended, "the stream did not end"
    assert ended[0].code() == grpc.StatusCode.UNAVAILABLE, ended[0]
    assert "shutting down" in (ended[0].details() or "")
    assert stopped_s < STOP_DEADLINE_S

    server.start()
    with connect(server.addr) as fila:
        assert fila.stats("orders").depth == 1
