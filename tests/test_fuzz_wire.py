"""Fuzzing every `fila.v1` RPC with arbitrary and mutated bytes, against a real broker.

Each example sends one call (or one short stream) through a raw channel with identity
serializers: either random bytes, or a well-formed request for that method (fields
drawn from its descriptor, names from a small pool so they often hit real queues)
that is then mutated (bytes flipped, cut, spliced, or unknown fields appended). The
broker may refuse anything, but only as a broker should: a status it documents, never
UNKNOWN or INTERNAL (an unhandled exception), never a stall past the deadline. After
the run it must still answer, stop gracefully on SIGTERM, start again, and still hold
every message it acknowledged before the run, byte for byte.

The default run is short (`FILA_FUZZ_EXAMPLES`, 200); `scripts/fuzz.sh` runs a long
one. A failure prints the method and the bytes, so it can be replayed.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.stubs import RPC_TIMEOUT_S, connect

from fila.core.records import message_id as id_of_key
from fila.storage import keys
from fila.storage.backend import RocksStorage
from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, messages_pb2, service_pb2

EXAMPLES = int(os.environ.get("FILA_FUZZ_EXAMPLES", "200"))
# A queue the fuzzer never names (its strings come from NAMES or short random text):
# what was acknowledged into it before the run must be there after it.
GUARDED = "guarded-6f1c2b9e-fuzz-never-names-this"
NAMES = ["fz", "fz.dlq", "other", "", "fz.*", "*", "throttle.t", "x" * 300, "no such"]
QUEUE_FIELDS = {"queue", "name", "dlq_queue"}
CALL_TIMEOUT_S = 15.0
# Statuses that mean the broker failed, not that it refused a bad request.
FAILURES = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNAVAILABLE,
}

METHODS: list[MethodDescriptor] = [
    method
    for module in (service_pb2, admin_pb2)
    for service in module.DESCRIPTOR.services_by_name.values()
    for method in service.methods
]


_THIRTY_TWO_BIT = {
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_UINT32,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_FIXED32,
    FieldDescriptor.TYPE_SFIXED32,
}

STORING = [m for m in METHODS if m.name in {"Enqueue", "EnqueueBatch", "StreamEnqueue"}]


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[object]:
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        if field.name in QUEUE_FIELDS:  # mostly a real queue, so requests get past lookup
            return st.one_of(st.sampled_from(["fz", "fz", "fz.dlq"]), st.sampled_from(NAMES))
        return st.one_of(st.sampled_from(NAMES), st.text(max_size=12))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [99])
    signed = kind in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SFIXED32,
        FieldDescriptor.TYPE_SFIXED64,
    )
    bits = 32 if kind in _THIRTY_TWO_BIT else 64
    edges = [0, 1, 2, 1000, 2**31 - 1] + ([-1, -(2**31)] if signed else [2**32 - 1])
    if bits == 64:
        edges += [2**63 - 1] + ([-(2**63)] if signed else [2**64 - 1])
    return st.sampled_from(edges)


def _fill(descriptor: Descriptor, depth: int) -> st.SearchStrategy[dict[str, object]]:
    """Values for some of `descriptor`'s fields, by name (nested messages as dicts)."""
    parts: dict[str, st.SearchStrategy[object]] = {}
    for field in descriptor.fields:
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                value = st.dictionaries(
                    st.sampled_from(NAMES[:4]) | st.text(max_size=6),
                    st.text(max_size=8),
                    max_size=3,
                )
            elif depth >= 2:
                continue
            else:
                value = _fill(field.message_type, depth + 1)
                if field.is_repeated:
                    value = st.lists(value, max_size=3)
        else:
            value = _scalar(field)
            if field.is_repeated:
                value = st.lists(value, max_size=3)
        parts[field.name] = value
    return st.fixed_dictionaries({}, optional=parts)


@st.composite
def _valid(draw: st.DrawFn, method: MethodDescriptor) -> bytes:
    cls = _message_class(method.input_type)
    values = draw(_fill(method.input_type, 0))
    try:
        return bytes(cls(**values).SerializeToString())
    except (ValueError, TypeError):  # a value the Python class refuses (e.g. a float range)
        return b""


def _message_class(descriptor: Descriptor) -> type:
    module = service_pb2 if descriptor.file.name.endswith("service.proto") else admin_pb2
    return getattr(module, descriptor.name)  # type: ignore[no-any-return]


@st.composite
def _mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    how = draw(st.sampled_from(["flip", "cut", "splice", "unknown", "unknown", "repeat", "as is"]))
    data = bytearray(raw)
    if how == "flip" and data:
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
    elif how == "cut" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == "splice":
        at = draw(st.integers(0, len(data)))
        data[at:at] = draw(st.binary(min_size=1, max_size=16))
    elif how == "unknown":
        number = draw(st.sampled_from([4, 5, 6, 9, 15, 100, 536870911]))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        tag = _varint(number << 3 | wire)
        body = {0: _varint(draw(st.integers(0, 2**64 - 1))), 1: bytes(8), 5: bytes(4)}.get(wire)
        if body is None:
            inner = draw(st.binary(max_size=32))
            body = _varint(len(inner)) + inner
        data += tag + body
    elif how == "repeat":
        data = data + bytes(data)
    return bytes(data)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@dataclass(frozen=True)
class Call:
    method: MethodDescriptor
    frames: tuple[bytes, ...]

    def __repr__(self) -> str:
        return f"Call({self.method.full_name}, {self.frames!r})"


@st.composite
def calls(draw: st.DrawFn) -> Call:
    # The paths that store client data are drawn as often as all the others together.
    method = draw(st.sampled_from(STORING) | st.sampled_from(METHODS))
    count = draw(st.integers(1, 3)) if method.client_streaming else 1
    frames = []
    for _ in range(count):
        if draw(st.booleans()):
            frames.append(draw(st.binary(max_size=128)))
        else:
            frames.append(draw(_mutated(draw(_valid(method)))))
    return Call(method, tuple(frames))


@pytest.fixture(scope="module")
def broker(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, dict[str, bytes]]]:
    """A broker with queues the fuzzer names and one it never does, holding messages
    acknowledged before the run: id -> payload."""
    root = tmp_path_factory.mktemp("fuzz")
    with ServerProcess(root / "data") as server:
        with connect(server.addr) as fila:
            for name in ("fz", "other", GUARDED):
                fila.create_queue(name)
            kept = {}
            for i in range(20):
                payload = random.randbytes(64) + b"%d" % i
                kept[fila.enqueue(GUARDED, payload, {"n": str(i)})] = payload
            for i in range(5):
                fila.enqueue("fz", b"fz-%d" % i)
        yield server, kept


def _send(channel: grpc.Channel, call: Call) -> grpc.StatusCode:
    path = f"/{call.method.containing_service.full_name}/{call.method.name}"
    ident = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    try:
        if not call.method.client_streaming and not call.method.server_streaming:
            channel.unary_unary(path, **ident)(call.frames[0], timeout=CALL_TIMEOUT_S)
            return grpc.StatusCode.OK
        if not call.method.client_streaming:
            stream = channel.unary_stream(path, **ident)(call.frames[0], timeout=CALL_TIMEOUT_S)
        else:
            stream = channel.stream_stream(path, **ident)(iter(call.frames), timeout=CALL_TIMEOUT_S)
        for _ in zip(range(2), stream, strict=False):  # a frame or two, then hang up
            pass
        stream.cancel()
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
        if code == grpc.StatusCode.CANCELLED:
            return grpc.StatusCode.OK  # ours
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and call.method.server_streaming:
            return grpc.StatusCode.OK  # a consume stream with nothing to deliver
        return code  # type: ignore[no-any-return]


def _check_stored(admin: admin_pb2_grpc.FilaAdminStub, call: Call) -> None:
    """What a storing call left in "fz" holds only fields the broker defines (a peek
    answers the stored record's fields, unknown ones included)."""
    try:
        page = admin.PeekMessages(
            admin_pb2.PeekMessagesRequest(queue="fz", limit=1000), timeout=CALL_TIMEOUT_S
        )
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND, f"{call!r} -> peek {err.code()}"
        return  # the fuzzer deleted "fz"
    for message in page.messages:
        size = message.ByteSize()
        message.DiscardUnknownFields()
        assert message.ByteSize() == size, f"{call!r} stored unknown fields"


def test_every_rpc_survives_arbitrary_and_mutated_bytes(
    broker: tuple[ServerProcess, dict[str, bytes]],
) -> None:
    server, kept = broker
    with grpc.insecure_channel(server.addr) as channel:
        admin = admin_pb2_grpc.FilaAdminStub(channel)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            database=None,
        )
        @given(call=calls())
        def one(call: Call) -> None:
            code = _send(channel, call)
            assert code not in FAILURES, f"{call!r} -> {code}"
            assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{call!r} stalled"
            if call.method in STORING:
                _check_stored(admin, call)

        one()
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING

    assert server.stop() == 0, server.log_text()[-3000:]
    storage = RocksStorage(server.data_dir)
    try:
        records = list(storage.scan(keys.MESSAGE))
    finally:
        storage.close()
    for key, raw in records:  # what the broker stored, it built: known fields, its own key
        message = messages_pb2.Message.FromString(raw)
        assert message.id == id_of_key(key)
        message.DiscardUnknownFields()
        # by size: the order of map entries is not kept through a parse
        assert message.ByteSize() == len(raw), f"record {message.id} holds unknown fields: {raw!r}"
    server.start()
    with connect(server.addr) as fila:
        page = fila.admin.PeekMessages(
            admin_pb2.PeekMessagesRequest(queue=GUARDED, limit=100), timeout=RPC_TIMEOUT_S
        )
    assert {m.id: m.payload for m in page.messages} == kept
    log = server.log_text()
    assert "Traceback" not in log
    assert "does not decode" not in log, "the broker stored a record it cannot read back"
