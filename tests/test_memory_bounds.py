"""Memory a client that never reads can make the broker hold, per byte, against a real
broker with its resident size measured.

The client is `support.h2raw` with a receive window of zero: the broker can send it
nothing, so every answer or delivery it is owed stays with the broker. Each test
waits until the broker has taken all it will take (what it stored or leased stops
changing), checks what it holds against the stated bound, then opens the window and
checks that everything owed arrives, in order.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from support import ServerFactory, resident_bytes_of, settled, wait_until
from support.cluster import Bearer
from support.h2raw import RawH2Connection
from support.stubs import RPC_TIMEOUT_S, Fila, connect

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, service_pb2
from fila.v1.admin_pb2_grpc import FilaAdminStub
from fila.v1.service_pb2_grpc import FilaServiceStub

MIB = 1024 * 1024
BOOT = "memory-bounds-bootstrap-key"
STREAM_ENQUEUE = "/fila.v1.FilaService/StreamEnqueue"
CONSUME = "/fila.v1.FilaService/Consume"
WITHIN_S = 30.0


@pytest.fixture
def secured(server_factory: ServerFactory) -> Iterator[tuple[ServerProcess, Fila]]:
    """A broker with auth on, and a client holding its bootstrap (superadmin) key."""
    server = server_factory(env={"FILA_BOOTSTRAP_APIKEY": BOOT})
    with grpc.insecure_channel(server.addr) as raw:
        channel = grpc.intercept_channel(raw, Bearer(BOOT))
        yield server, Fila(channel, FilaServiceStub(channel), FilaAdminStub(channel))


def _auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _key(fila: Fila, kind: str, pattern: str) -> str:
    """A new API key allowed `kind` on `pattern` only."""
    created = fila.admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(name=f"{kind}-{pattern}"), timeout=RPC_TIMEOUT_S
    )
    fila.admin.SetAcl(
        admin_pb2.SetAclRequest(
            key_id=created.key_id,
            permissions=[admin_pb2.AclPermission(kind=kind, pattern=pattern)],
        ),
        timeout=RPC_TIMEOUT_S,
    )
    return created.key


# -- StreamEnqueue: failed items ---------------------------------------------------------

STREAMS = 8
REQUESTS = 6
ITEMS = 10_000
# What the broker may hold for them beyond its size before (docs/operations.md,
# "Memory"): per stream, its owed answers (1.5 MiB at the default batch limit) and
# one answer more (under 1 MiB here), plus the requests gRPC read ahead of the
# handler (all of them here, under 1.2 MiB a stream) and the heap's slack.
FAILED_BOUND = STREAMS * 8 * MIB


@pytest.mark.parametrize(
    ("acl", "named", "kind"),
    [
        ("*", "nope", "queue_not_found"),  # a queue that does not exist
        ("q", "other", "permission_denied"),  # a queue the key may not touch
    ],
)
def test_a_stream_enqueue_that_never_reads_holds_its_failed_answers_as_bytes(
    secured: tuple[ServerProcess, Fila], acl: str, named: str, kind: str
) -> None:
    """Each request carries one message for queue q and 9,999 that fail. Every failed
    item used to be held as its exception and traceback (with the frame, its request
    and results) until its answer was written: 9-14 MiB per non-reading stream."""
    server, fila = secured
    fila.create_queue("q")
    key = _key(fila, "produce", acl)
    messages = [service_pb2.EnqueueRequest(queue="q", payload=b"x")]
    messages += [service_pb2.EnqueueRequest(queue=named, payload=b"x")] * (ITEMS - 1)

    def depth() -> int:
        return fila.stats("q").depth

    before = resident_bytes_of(server.pid)
    with RawH2Connection(server.host, server.port, receive_window=0).start() as client:
        streams = [1 + 2 * n for n in range(STREAMS)]
        for stream in streams:
            client.open_call(stream, STREAM_ENQUEUE, _auth(key))
        for sequence in range(REQUESTS):
            request = service_pb2.StreamEnqueueRequest(
                sequence_number=sequence, messages=messages
            ).SerializeToString()
            for stream in streams:
                assert client.send_message(stream, request, within=10), "the broker read on"
        taken = settled(depth)
        held = resident_bytes_of(server.pid) - before
        assert taken < STREAMS * REQUESTS, "a stream that reads nothing is read no further"
        assert held < FAILED_BOUND, f"{held / MIB:.0f} MiB held for {taken} requests"

        for stream in streams:
            client.grant(stream, 1 << 30)
            client.end_requests(stream)

        def all_ended() -> bool:
            client.pump(0.05)
            return all(client.ended(stream) for stream in streams)

        wait_until(all_ended, WITHIN_S, what="every stream answered and ended")
    assert depth() == STREAMS * REQUESTS
    for stream in streams:
        answers = [service_pb2.StreamEnqueueResponse.FromString(a) for a in client.answers(stream)]
        assert [a.sequence_number for a in answers] == list(range(REQUESTS))
        for answer in answers:
            assert answer.results[0].message_id
            assert {r.error.kind for r in answer.results[1:]} == {kind}
            assert len(answer.results) == ITEMS


# -- Consume: frames gRPC has not written --------------------------------------------------

CONSUMERS = 32
PAYLOAD = 16 * 1024
STREAM_BUFFER = 512 * 1024
TOTAL_BUFFER = 16 * MIB
BUFFERS = (
    f"[scheduler]\nstream_buffer_bytes = {STREAM_BUFFER}\ntotal_buffer_bytes = {TOTAL_BUFFER}\n"
)
# Messages leased to the streams are all the broker holds for them: the broker-wide
# budget, which a stream may pass by one message (docs/semantics.md).
LEASED_BOUND = TOTAL_BUFFER + CONSUMERS * PAYLOAD
# The leased messages twice (a frame is built as a copy of its records, and gRPC
# keeps a copy of a frame it has not written), and the heap's slack.
CONSUMED_BOUND = 2 * LEASED_BOUND + 8 * MIB


def test_consume_streams_that_never_read_hold_no_more_than_the_buffer_budget(
    server_factory: ServerFactory,
) -> None:
    """A frame handed to gRPC stays in the broker until the client's window lets it
    out. It used to leave the buffer budget when it was handed over, so every stream
    that never read held a frame beyond the budget, and was given a full buffer more:
    198 MiB added with `total_buffer_bytes` at 64 MiB."""
    server = server_factory(config_toml=BUFFERS)
    messages = 6_000  # more than the streams could take even beyond the budget
    with connect(server.addr) as fila:
        fila.create_queue("q")
        batch = [service_pb2.EnqueueRequest(queue="q", payload=bytes(PAYLOAD))] * 500
        for _ in range(messages // len(batch)):
            fila.svc.EnqueueBatch(
                service_pb2.EnqueueBatchRequest(messages=batch), timeout=RPC_TIMEOUT_S
            )
    server.restart()  # its resident size from here on is what consuming takes
    with connect(server.addr) as fila:

        def leased() -> int:
            return fila.stats("q").in_flight

        before = resident_bytes_of(server.pid)
        with RawH2Connection(server.host, server.port, receive_window=0).start() as client:
            streams = [1 + 2 * n for n in range(CONSUMERS)]
            request = service_pb2.ConsumeRequest(queue="q", prefetch=1000, max_batch=1000)
            for stream in streams:
                client.open_call(stream, CONSUME)
                assert client.send_message(stream, request.SerializeToString(), within=10)
                client.end_requests(stream)
            held = settled(leased)
            grown = resident_bytes_of(server.pid) - before
            assert grown < CONSUMED_BOUND, f"{grown / MIB:.0f} MiB held for {held} messages"
            assert held * PAYLOAD <= LEASED_BOUND, f"{held} messages leased"

            for stream in streams:
                client.grant(stream, 1 << 30)
            seen: set[str] = set()
            counted = dict.fromkeys(streams, 0)

            def delivered() -> int:
                client.pump(0.05)
                for stream in streams:
                    frames = client.answers(stream)
                    for frame in frames[counted[stream] :]:
                        response = service_pb2.ConsumeResponse.FromString(frame)
                        seen.update(message.id for message in response.messages)
                    counted[stream] = len(frames)
                return len(seen)

            wait_until(lambda: delivered() == messages, WITHIN_S, what="every message sent")
