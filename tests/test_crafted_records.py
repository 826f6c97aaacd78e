"""Client bytes never become broker state: crafted requests against a real broker.

The stored message record once was the `EnqueueRequest`'s own serialization, unknown
fields included, re-read as a `fila.v1.Message`, where field 4 is `metadata` (in the
request it is `delay_ms`) and field 5 `timestamps`. One extra length-delimited field
4 holding an invalid UTF-8 fairness key made a record nothing could read back: peek
failed, consumers failed, lease expiry stopped the timers, a stream nack killed the
settlement reader, and the broker refused to start. A key that may only produce
could do it through every enqueue path. Unknown fields that did decode were merged
into the record: data past the size limit, an attempt count, another tenant's
throttle key, a lease time. Each test below sends such bytes raw (identity
serializers) and checks what the broker stored and does.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import grpc
from support import ServerFactory, wait_until
from support.stubs import RPC_TIMEOUT_S, connect

from fila.core.frames import varint
from fila.core.records import message_id as id_of_key
from fila.storage import keys
from fila.storage.backend import Batch, RocksStorage
from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, messages_pb2, service_pb2, service_pb2_grpc

BOOT = "crafted-records-bootstrap-key"
# A length-delimited field 4 holding MessageMetadata{fairness_key: "\xff"}: as a record's
# metadata, invalid UTF-8; in a request, a field 4 of the wrong wire type (unknown).
POISON = b"\x22\x03\x0a\x01\xff"


def _field(number: int, body: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(body)) + body


def crafted(queue: str, payload: bytes, extra: bytes) -> bytes:
    return service_pb2.EnqueueRequest(queue=queue, payload=payload).SerializeToString() + extra


def _raw_unary(channel: grpc.Channel, method: str) -> grpc.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        method, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )


def _md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def producer_key(server: ServerProcess, queue: str) -> str:
    """A key that holds only `produce:<queue>`."""
    with connect(server.addr) as fila:
        made = fila.admin.CreateApiKey(
            admin_pb2.CreateApiKeyRequest(name="producer"), metadata=_md(BOOT), timeout=10
        )
        fila.admin.SetAcl(
            admin_pb2.SetAclRequest(
                key_id=made.key_id,
                permissions=[admin_pb2.AclPermission(kind="produce", pattern=queue)],
            ),
            metadata=_md(BOOT),
            timeout=10,
        )
    return str(made.key)


def enqueue_every_way(server: ServerProcess, key: str, item: bytes) -> list[str]:
    """`item` (a serialized EnqueueRequest) through Enqueue, EnqueueBatch and
    StreamEnqueue, as `key`; the ids the broker answered."""
    with grpc.insecure_channel(server.addr) as channel:
        unary = service_pb2.EnqueueResponse.FromString(
            _raw_unary(channel, "/fila.v1.FilaService/Enqueue")(
                item, metadata=_md(key), timeout=RPC_TIMEOUT_S
            )
        ).message_id
        batch = service_pb2.EnqueueBatchResponse.FromString(
            _raw_unary(channel, "/fila.v1.FilaService/EnqueueBatch")(
                _field(1, item), metadata=_md(key), timeout=RPC_TIMEOUT_S
            )
        )
        stream = channel.stream_stream(
            "/fila.v1.FilaService/StreamEnqueue",
            request_serializer=lambda b: b,
            response_deserializer=service_pb2.StreamEnqueueResponse.FromString,
        )
        answers = list(
            stream(iter([b"\x08\x01" + _field(2, item)]), metadata=_md(key), timeout=RPC_TIMEOUT_S)
        )
    ids = [unary, batch.results[0].message_id, answers[0].results[0].message_id]
    assert all(ids), (batch, answers)
    return ids


def peek(server: ServerProcess, queue: str) -> list[messages_pb2.Message]:
    with connect(server.addr) as fila:
        page = fila.admin.PeekMessages(
            admin_pb2.PeekMessagesRequest(queue=queue, limit=100),
            metadata=_md(BOOT),
            timeout=RPC_TIMEOUT_S,
        )
    return list(page.messages)


def stored_records(server: ServerProcess) -> Iterator[tuple[bytes, bytes]]:
    """The message records on disk (the broker stopped)."""
    storage = RocksStorage(server.data_dir)
    try:
        records = list(storage.scan(keys.MESSAGE))
    finally:
        storage.close()
    yield from records


def test_a_poisoned_enqueue_through_every_path_is_stored_clean_and_served(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(env={"FILA_BOOTSTRAP_APIKEY": BOOT})
    with connect(server.addr) as fila:
        fila.admin.CreateQueue(
            admin_pb2.CreateQueueRequest(
                name="q", config=admin_pb2.QueueConfig(visibility_timeout_ms=1000)
            ),
            metadata=_md(BOOT),
            timeout=RPC_TIMEOUT_S,
        )
    key = producer_key(server, "q")
    poisoned = enqueue_every_way(server, key, crafted("q", b"poisoned", POISON))
    good = enqueue_every_way(server, key, crafted("q", b"good", b""))

    peeked = peek(server, "q")
    assert sorted(m.id for m in peeked) == sorted(poisoned + good)
    assert {m.metadata.fairness_key for m in peeked} == {"default"}

    with grpc.insecure_channel(server.addr) as channel:
        svc = service_pb2_grpc.FilaServiceStub(channel)
        # One frame of all six, never acked: every lease expires (one timer entry),
        # and all six come back with attempt 1.
        first = svc.Consume(
            service_pb2.ConsumeRequest(queue="q", max_batch=10, prefetch=10), metadata=_md(BOOT)
        )
        delivered: list[messages_pb2.Message] = []
        for response in first:
            delivered += list(response.messages)
            if len(delivered) == 6:
                break
        first.cancel()
        assert sorted(m.id for m in delivered) == sorted(poisoned + good)

        # StreamConsume: nack a poisoned one, ack the rest, on one stream.
        settle: list[service_pb2.StreamConsumeRequest] = []
        opened = service_pb2.StreamConsumeRequest(queue="q", max_batch=10, prefetch=10)

        def requests() -> Iterator[service_pb2.StreamConsumeRequest]:
            yield opened
            while True:
                wait_until(lambda: settle, timeout=20.0, what="a settlement to send")
                request = settle.pop(0)
                if not request.queue and not request.ack_ids and not request.nacks:
                    return
                yield request

        stream = svc.StreamConsume(requests(), metadata=_md(BOOT))
        seen: dict[str, int] = {}
        nacked = False
        for response in stream:
            for message in response.messages:
                seen[message.id] = message.metadata.attempt_count
                if message.id == poisoned[0] and not nacked:
                    nacked = True
                    nack = service_pb2.NackRequest(message_id=message.id, error="x")
                    settle.append(service_pb2.StreamConsumeRequest(nacks=[nack]))
                else:
                    settle.append(service_pb2.StreamConsumeRequest(ack_ids=[message.id]))
            if nacked and len(seen) == 6 and seen[poisoned[0]] == 2:
                break
        assert set(seen) == set(poisoned + good)
        assert all(seen[i] >= 1 for i in good)  # came back from the expired leases
        wait_until(lambda: not peek(server, "q"), timeout=20.0, what="every settlement applied")
        settle.append(service_pb2.StreamConsumeRequest())
        stream.cancel()

    assert server.stop() == 0  # SIGTERM: a graceful stop
    assert list(stored_records(server)) == []  # every message acked, nothing left over
    server.start()  # once: exit 4, "message record ... does not decode"
    with connect(server.addr) as fila:
        stats = fila.admin.GetStats(
            admin_pb2.GetStatsRequest(queue="q"), metadata=_md(BOOT), timeout=RPC_TIMEOUT_S
        )
        assert (stats.depth, stats.in_flight) == (0, 0)
    assert "set aside" not in server.log_text()
    assert server.stop() == 0
    done = repair(server)
    assert done.returncode == 0 and "set aside" not in done.stdout, done.stdout


def test_unknown_fields_are_dropped_not_stored_or_merged(server_factory: ServerFactory) -> None:
    """8 MiB of unknown field past a 1 MiB message limit; a smuggled metadata with an
    attempt count and another tenant's throttle key; a smuggled lease time."""
    server = server_factory(config_toml="[server]\nmax_message_bytes = 1048576\n")
    smuggled_meta = messages_pb2.MessageMetadata(attempt_count=7, throttle_keys=["victim"])
    leased = messages_pb2.MessageTimestamps()
    leased.leased_at.FromMilliseconds(1_700_000_000_000)
    extra = (
        _field(100, bytes(8 * 1024 * 1024))
        + _field(4, smuggled_meta.SerializeToString())
        + _field(5, leased.SerializeToString())
    )
    with connect(server.addr) as fila:
        fila.create_queue("q")
        with grpc.insecure_channel(server.addr) as channel:
            reply = _raw_unary(channel, "/fila.v1.FilaService/Enqueue")(
                crafted("q", b"four", extra), timeout=RPC_TIMEOUT_S
            )
        message_id = service_pb2.EnqueueResponse.FromString(reply).message_id
        (peeked,) = peek(server, "q")
        assert peeked.id == message_id and peeked.payload == b"four"
        assert not peeked.timestamps.HasField("leased_at")
        assert list(peeked.metadata.throttle_keys) == [] and peeked.metadata.attempt_count == 0
        # A consumer with the documented receive limit reads it; attempt 0 on first delivery.
        limited = grpc.insecure_channel(
            server.addr, options=[("grpc.max_receive_message_length", 1024 * 1024 + 64 * 1024)]
        )
        with limited:
            stream = service_pb2_grpc.FilaServiceStub(limited).Consume(
                service_pb2.ConsumeRequest(queue="q")
            )
            delivered = next(r.message for r in stream if r.HasField("message"))
            stream.cancel()
        assert delivered.id == message_id and delivered.metadata.attempt_count == 0
        assert list(delivered.metadata.throttle_keys) == []
    assert server.stop() == 0
    ((key, raw),) = stored_records(server)
    assert len(raw) < 1024, f"the stored record is {len(raw)} bytes"
    assert messages_pb2.Message.FromString(raw).id == id_of_key(key)
    server.start()
    with connect(server.addr) as fila:
        (peeked,) = peek(server, "q")
        assert list(peeked.metadata.throttle_keys) == []  # after a restart too
        assert fila.stats("q").depth + fila.stats("q").in_flight == 1


def test_a_record_that_does_not_decode_is_set_aside_at_start_and_listed_by_repair(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("q")
        ids = [fila.enqueue("q", b"%d" % i) for i in range(3)]
    assert server.stop() == 0
    storage = RocksStorage(server.data_dir)
    batch = Batch()
    batch.put(keys.message_key(ids[1]), POISON)
    storage.write(batch)
    storage.sync()
    storage.close()

    server.start()  # once: exit 4, "message record ... does not decode"
    with connect(server.addr) as fila:
        assert fila.stats("q").depth == 2
        page = fila.admin.PeekMessages(
            admin_pb2.PeekMessagesRequest(queue="q"), timeout=RPC_TIMEOUT_S
        )
        assert [m.id for m in page.messages] == [ids[0], ids[2]]
    assert "does not decode; it was set aside" in server.log_text()
    assert server.stop() == 0

    done = repair(server)
    assert done.returncode == 0, done.stderr
    assert "1 record(s) that do not decode are set aside" in done.stdout, done.stdout
    assert repair(server, "--drop-quarantined").returncode == 0
    assert "set aside" not in repair(server).stdout


def repair(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """`fila-server --repair` on the stopped `server`'s data directory."""
    return subprocess.run(
        [sys.executable, "-m", "fila.server.main", "--repair", *args],
        env={"FILA_DATA_DIR": str(server.data_dir), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
