"""A graceful stop (SIGTERM) ends every open stream at once, with a status that says
to try again, instead of waiting out `server.shutdown_grace_ms`."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
from support import ServerFactory
from support.cluster import cluster
from support.stubs import connect

from fila.testing.server import ServerProcess
from fila.v1 import service_pb2, service_pb2_grpc

# far longer than the stop may take, so waiting it out cannot pass
GRACE = "[server]\nshutdown_grace_ms = 60000\n"
STOP_DEADLINE_S = 10.0


class _Producer:
    """A StreamEnqueue kept open, as the SDK keeps one per client: requests are sent
    one at a time, and the stream stays idle in between."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.Queue[service_pb2.StreamEnqueueRequest | None] = queue.Queue()
        call = service_pb2_grpc.FilaServiceStub(channel).StreamEnqueue(self._request_stream())
        self._answers = iter(call)
        self._sequence = 0
        self.ended: list[grpc.RpcError] = []

    def _request_stream(self) -> Iterator[service_pb2.StreamEnqueueRequest]:
        while (request := self._requests.get()) is not None:
            yield request

    def send(self, *queues: str) -> service_pb2.StreamEnqueueResponse:
        """One request with a message for each of `queues`; its answer."""
        self._sequence += 1
        self._requests.put(
            service_pb2.StreamEnqueueRequest(
                sequence_number=self._sequence,
                messages=[service_pb2.EnqueueRequest(queue=q, payload=b"kept") for q in queues],
            )
        )
        return next(self._answers)

    def stop_broker(self, broker: ServerProcess) -> float:
        """SIGTERMs `broker` while the stream is idle; seconds until it exited (raises
        if it took STOP_DEADLINE_S) and the stream's end is in `ended`."""
        reader = threading.Thread(target=self._read_to_the_end)
        reader.start()
        started = time.monotonic()
        assert broker.stop(timeout=STOP_DEADLINE_S) == 0
        stopped_s = time.monotonic() - started
        reader.join(STOP_DEADLINE_S)
        self._requests.put(None)
        return stopped_s

    def _read_to_the_end(self) -> None:
        try:
            for _ in self._answers:
                pass
        except grpc.RpcError as exc:
            self.ended.append(exc)

    def assert_ended_shutting_down(self) -> None:
        assert self.ended, "the stream did not end"
        assert self.ended[0].code() == grpc.StatusCode.UNAVAILABLE, self.ended[0]
        assert "shutting down" in (self.ended[0].details() or "")


def _stored(answer: service_pb2.StreamEnqueueResponse) -> bool:
    return all(r.WhichOneof("result") == "message_id" for r in answer.results)


def test_sigterm_ends_an_idle_stream_enqueue_at_once_with_unavailable(
    server_factory: ServerFactory,
) -> None:
    """Before, one idle producer held the stop for the whole grace period and then saw
    CANCELLED."""
    server = server_factory(config_toml=GRACE)
    with connect(server.addr) as fila:
        fila.create_queue("orders")
    with grpc.insecure_channel(server.addr) as channel:
        producer = _Producer(channel)
        assert _stored(producer.send("orders"))
        assert producer.stop_broker(server) < STOP_DEADLINE_S

    producer.assert_ended_shutting_down()
    server.start()
    with connect(server.addr) as fila:
        assert fila.stats("orders").depth == 1


def test_sigterm_ends_a_stream_enqueue_split_across_nodes_at_once(tmp_path: Path) -> None:
    """In a cluster the node's edge reads the stream and forwards parts to the owners:
    a node stopping with a producer's stream open through it, its last request split
    between another node's queue and its own, ends the stream the same way."""
    with cluster(tmp_path, 1) as made:
        made.add(2, extra=GRACE)
        first, second = (f"q{i}-{uuid.uuid4().hex[:6]}" for i in (1, 2))
        made.fila(1).create_queue(first)
        made.fila(1).create_queue(second)  # the node with fewer queues: the other one
        leaders = made.leaders(1)
        assert {leaders[first], leaders[second]} == {1, 2}, leaders
        producer = _Producer(made.channel(2))
        assert _stored(producer.send(first, second))
        assert producer.stop_broker(made.node(2)) < STOP_DEADLINE_S
    producer.assert_ended_shutting_down()
