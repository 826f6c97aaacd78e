"""The `fila.v1` wire contract (SPEC section 1), checked three ways.

(a) A client generated from `proto/` alone (fresh `grpc_tools.protoc` output, no
    `fila_sdk`, not the committed stubs, not the repository on `sys.path`) runs the
    whole life cycle against a real broker, as a published SDK would.
(b) Every field of every message in SPEC section 1 is pinned here by number and
    type, and every RPC by request/response type and streaming; the table is
    checked against the committed descriptors, against the descriptors the running
    broker serves through reflection, and the committed stubs against `proto/`.
(c) Standard gRPC health checking and server reflection.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from support import ServerProcess

from fila.v1 import admin_pb2, messages_pb2, service_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto"
PROTO_FILES = ["fila/v1/messages.proto", "fila/v1/service.proto", "fila/v1/admin.proto"]

# ----------------------------------------------------------------------------- (b)
# SPEC section 1, transcribed: message -> field -> (number, type). "M" stands for a
# message of package fila.v1.
TS = "google.protobuf.Timestamp"
FIELDS: dict[str, dict[str, tuple[int, str]]] = {
    # messages.proto
    "Message": {
        "id": (1, "string"),
        "headers": (2, "map<string,string>"),
        "payload": (3, "bytes"),
        "metadata": (4, "M.MessageMetadata"),
        "timestamps": (5, "M.MessageTimestamps"),
    },
    "MessageMetadata": {
        "fairness_key": (1, "string"),
        "weight": (2, "uint32"),
        "throttle_keys": (3, "repeated string"),
        "attempt_count": (4, "uint32"),
        "queue_id": (5, "string"),
        # job-queue additions, second round
        "last_error": (6, "string"),
        "last_failed_at": (7, TS),
        "dead_lettered_at": (8, TS),
    },
    "MessageTimestamps": {"enqueued_at": (1, TS), "leased_at": (2, TS)},
    # service.proto
    "EnqueueRequest": {
        "queue": (1, "string"),
        "headers": (2, "map<string,string>"),
        "payload": (3, "bytes"),
        "delay_ms": (4, "uint64"),  # job-queue additions
    },
    "EnqueueResponse": {"message_id": (1, "string")},
    "ConsumeRequest": {"queue": (1, "string")},
    "ConsumeResponse": {"message": (1, "M.Message")},
    "AckRequest": {"queue": (1, "string"), "message_id": (2, "string")},
    "AckResponse": {},
    "NackRequest": {"queue": (1, "string"), "message_id": (2, "string"), "error": (3, "string")},
    "NackResponse": {},
    # admin.proto
    "CreateQueueRequest": {"name": (1, "string"), "config": (2, "M.QueueConfig")},
    "CreateQueueResponse": {"queue_id": (1, "string")},
    "QueueConfig": {
        "on_enqueue_script": (1, "string"),
        "on_failure_script": (2, "string"),
        "visibility_timeout_ms": (3, "uint64"),
        # job-queue additions, second round
        "max_attempts": (4, "uint32"),
        "retry_backoff": (5, "string"),
    },
    "DeleteQueueRequest": {"queue": (1, "string")},
    "DeleteQueueResponse": {},
    "ListQueuesRequest": {},
    "ListQueuesResponse": {
        "queues": (1, "repeated M.QueueInfo"),
        "cluster_node_count": (2, "uint32"),
    },
    "QueueInfo": {
        "name": (1, "string"),
        "depth": (2, "uint64"),
        "in_flight": (3, "uint64"),
        "active_consumers": (4, "uint32"),
        "leader_node_id": (5, "uint64"),
    },
    "GetStatsRequest": {"queue": (1, "string")},
    "GetStatsResponse": {
        "depth": (1, "uint64"),
        "in_flight": (2, "uint64"),
        "active_fairness_keys": (3, "uint64"),
        "active_consumers": (4, "uint32"),
        "quantum": (5, "uint32"),
        "per_key_stats": (6, "repeated M.PerFairnessKeyStats"),
        "per_throttle_stats": (7, "repeated M.PerThrottleKeyStats"),
        "leader_node_id": (8, "uint64"),
        "replication_count": (9, "uint32"),
        # job-queue additions
        "enqueued_total": (10, "uint64"),
        "delivered_total": (11, "uint64"),
        "acked_total": (12, "uint64"),
        "nacked_total": (13, "uint64"),
        "expired_total": (14, "uint64"),
        "dead_lettered_total": (15, "uint64"),
        # job-queue additions, second round
        "delayed": (16, "uint64"),
        "hook_errors_total": (17, "uint64"),
        "last_hook_error": (18, "string"),
        "last_hook_error_at": (19, TS),
    },
    "PerFairnessKeyStats": {
        "key": (1, "string"),
        "pending_count": (2, "uint64"),
        "current_deficit": (3, "int64"),
        "weight": (4, "uint32"),
        "delivered_total": (5, "uint64"),
    },
    "PerThrottleKeyStats": {
        "key": (1, "string"),
        "tokens": (2, "double"),
        "rate_per_second": (3, "double"),
        "burst": (4, "double"),
    },
    "SetConfigRequest": {"key": (1, "string"), "value": (2, "string")},
    "SetConfigResponse": {},
    "GetConfigRequest": {"key": (1, "string")},
    "GetConfigResponse": {"value": (1, "string")},
    "ListConfigRequest": {"prefix": (1, "string")},
    "ListConfigResponse": {
        "entries": (1, "repeated M.ConfigEntry"),
        "total_count": (2, "uint32"),
    },
    "ConfigEntry": {"key": (1, "string"), "value": (2, "string")},
    "RedriveRequest": {"dlq_queue": (1, "string"), "count": (2, "uint64")},
    "RedriveResponse": {"redriven": (1, "uint64")},
    "CreateApiKeyRequest": {
        "name": (1, "string"),
        "expires_at_ms": (2, "uint64"),
        "is_superadmin": (3, "bool"),
    },
    "CreateApiKeyResponse": {
        "key_id": (1, "string"),
        "key": (2, "string"),
        "is_superadmin": (3, "bool"),
    },
    "RevokeApiKeyRequest": {"key_id": (1, "string")},
    "RevokeApiKeyResponse": {},
    "ListApiKeysRequest": {},
    "ListApiKeysResponse": {"keys": (1, "repeated M.ApiKeyInfo")},
    "ApiKeyInfo": {
        "key_id": (1, "string"),
        "name": (2, "string"),
        "created_at_ms": (3, "uint64"),
        "expires_at_ms": (4, "uint64"),
        "is_superadmin": (5, "bool"),
    },
    "SetAclRequest": {"key_id": (1, "string"), "permissions": (2, "repeated M.AclPermission")},
    "SetAclResponse": {},
    "AclPermission": {"kind": (1, "string"), "pattern": (2, "string")},
    "GetAclRequest": {"key_id": (1, "string")},
    "GetAclResponse": {
        "key_id": (1, "string"),
        "permissions": (2, "repeated M.AclPermission"),
        "is_superadmin": (3, "bool"),
    },
    # job-queue additions (this broker's extensions, SPEC 1)
    "ExtendLeaseRequest": {
        "queue": (1, "string"),
        "message_id": (2, "string"),
        "extend_ms": (3, "uint64"),
    },
    "ExtendLeaseResponse": {"deadline": (1, TS)},
    "PeekMessagesRequest": {
        "queue": (1, "string"),
        "limit": (2, "uint32"),
        "after_id": (3, "string"),
        "fairness_key": (4, "string"),
        "state": (5, "enum fila.v1.MessageState"),
    },
    "PeekMessagesResponse": {
        "messages": (1, "repeated M.Message"),
        "next_after_id": (2, "string"),
        "states": (3, "repeated M.PeekedState"),
    },
    "PeekedState": {
        "state": (1, "enum fila.v1.MessageState"),
        "ready_at": (2, TS),
        "lease_deadline": (3, TS),
    },
    "PurgeQueueRequest": {"queue": (1, "string")},
    "PurgeQueueResponse": {"purged": (1, "uint64")},
    "GetQueueRequest": {"queue": (1, "string")},
    "GetQueueResponse": {
        "name": (1, "string"),
        "config": (2, "M.QueueConfig"),
        "dlq": (3, "string"),
    },
    "UpdateQueueRequest": {
        "queue": (1, "string"),
        "config": (2, "M.QueueConfig"),
        "update_mask": (3, "repeated string"),
    },
    "UpdateQueueResponse": {"config": (1, "M.QueueConfig")},
    # cluster mode (SPEC 9)
    "ClusterStatusRequest": {},
    "ClusterStatusResponse": {
        "enabled": (1, "bool"),
        "node_id": (2, "uint64"),
        "nodes": (3, "repeated M.ClusterNodeStatus"),
    },
    "ClusterNodeStatus": {
        "node_id": (1, "uint64"),
        "advertise_addr": (2, "string"),
        "up": (3, "bool"),
        "queue_count": (4, "uint32"),
    },
}

# enum -> value -> number (SPEC 1, job-queue additions, second round)
ENUMS: dict[str, dict[str, int]] = {
    "MessageState": {"MESSAGE_STATE_UNSPECIFIED": 0, "READY": 1, "DELAYED": 2, "LEASED": 3},
}

# service -> rpc -> (request, response, server streaming)
RPCS: dict[str, dict[str, tuple[str, str, bool]]] = {
    "FilaService": {
        "Enqueue": ("EnqueueRequest", "EnqueueResponse", False),
        "Consume": ("ConsumeRequest", "ConsumeResponse", True),
        "Ack": ("AckRequest", "AckResponse", False),
        "Nack": ("NackRequest", "NackResponse", False),
        "ExtendLease": ("ExtendLeaseRequest", "ExtendLeaseResponse", False),
    },
    "FilaAdmin": {
        name: (f"{name}Request", f"{name}Response", False)
        for name in (
            "CreateQueue",
            "DeleteQueue",
            "ListQueues",
            "GetStats",
            "SetConfig",
            "GetConfig",
            "ListConfig",
            "Redrive",
            "CreateApiKey",
            "RevokeApiKey",
            "ListApiKeys",
            "SetAcl",
            "GetAcl",
            "PeekMessages",
            "PurgeQueue",
            "ClusterStatus",
            "GetQueue",
            "UpdateQueue",
        )
    },
}

# Which .proto file each message lives in (SPEC section 1 groups them this way).
FILE_OF = {
    "Message": "fila/v1/messages.proto",
    "MessageMetadata": "fila/v1/messages.proto",
    "MessageTimestamps": "fila/v1/messages.proto",
    **{
        m: "fila/v1/service.proto"
        for m in (
            "EnqueueRequest",
            "EnqueueResponse",
            "ConsumeRequest",
            "ConsumeResponse",
            "AckRequest",
            "AckResponse",
            "NackRequest",
            "NackResponse",
        )
    },
}

_SCALARS = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_UINT32: "uint32",
    FieldDescriptor.TYPE_UINT64: "uint64",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_SINT32: "sint32",
    FieldDescriptor.TYPE_SINT64: "sint64",
    FieldDescriptor.TYPE_FIXED32: "fixed32",
    FieldDescriptor.TYPE_FIXED64: "fixed64",
    FieldDescriptor.TYPE_DOUBLE: "double",
    FieldDescriptor.TYPE_FLOAT: "float",
}


def _type_name(field: FieldDescriptor) -> str:
    msg = field.message_type
    if msg is not None and msg.GetOptions().map_entry:
        key, value = msg.fields_by_name["key"], msg.fields_by_name["value"]
        return f"map<{_type_name(key)},{_type_name(value)}>"
    if msg is not None:
        base = msg.full_name.replace("fila.v1.", "M.", 1)
    elif field.enum_type is not None:
        base = "enum " + field.enum_type.full_name
    else:
        base = _SCALARS[field.type]
    return f"repeated {base}" if field.is_repeated else base


def _contract_violations(pool: descriptor_pool.DescriptorPool) -> list[str]:
    problems: list[str] = []
    for message, fields in FIELDS.items():
        try:
            desc: Descriptor = pool.FindMessageTypeByName(f"fila.v1.{message}")
        except KeyError:
            problems.append(f"message fila.v1.{message} is missing")
            continue
        if message in FILE_OF and desc.file.name != FILE_OF[message]:
            problems.append(f"{message} is in {desc.file.name}, expected {FILE_OF[message]}")
        for name, (number, type_name) in fields.items():
            field = desc.fields_by_name.get(name)
            if field is None:
                problems.append(f"{message}.{name} is missing")
                continue
            actual = (field.number, _type_name(field))
            if actual != (number, type_name):
                problems.append(f"{message}.{name} is {actual}, expected {(number, type_name)}")
    for enum, values in ENUMS.items():
        try:
            edesc = pool.FindEnumTypeByName(f"fila.v1.{enum}")
        except KeyError:
            problems.append(f"enum fila.v1.{enum} is missing")
            continue
        actual_values = {v.name: v.number for v in edesc.values}
        if actual_values != values:
            problems.append(f"enum {enum} is {actual_values}, expected {values}")
    for service, rpcs in RPCS.items():
        try:
            sdesc: ServiceDescriptor = pool.FindServiceByName(f"fila.v1.{service}")
        except KeyError:
            problems.append(f"service fila.v1.{service} is missing")
            continue
        for rpc, (request, response, streaming) in rpcs.items():
            method = sdesc.methods_by_name.get(rpc)
            if method is None:
                problems.append(f"{service}.{rpc} is missing")
                continue
            actual_sig = (
                method.input_type.full_name,
                method.output_type.full_name,
                method.client_streaming,
                method.server_streaming,
            )
            expected_sig = (f"fila.v1.{request}", f"fila.v1.{response}", False, streaming)
            if actual_sig != expected_sig:
                problems.append(f"{service}.{rpc} is {actual_sig}, expected {expected_sig}")
    return problems


def test_committed_descriptors_match_the_spec_table() -> None:
    assert (messages_pb2.DESCRIPTOR.package, service_pb2.DESCRIPTOR.package) == (
        "fila.v1",
        "fila.v1",
    )
    assert admin_pb2.DESCRIPTOR.package == "fila.v1"
    assert _contract_violations(descriptor_pool.Default()) == []


def test_contract_checker_catches_a_renumbered_field() -> None:
    """The check above can fail: a copy of the contract with one field renumbered is caught."""
    pool = descriptor_pool.DescriptorPool()
    from google.protobuf import timestamp_pb2

    stamp = descriptor_pb2.FileDescriptorProto.FromString(timestamp_pb2.DESCRIPTOR.serialized_pb)
    pool.Add(stamp)
    for module in (messages_pb2, service_pb2, admin_pb2):
        proto = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        if module is messages_pb2:
            meta = next(m for m in proto.message_type if m.name == "MessageMetadata")
            attempt = next(f for f in meta.field if f.name == "attempt_count")
            attempt.number = 9  # a number no field of MessageMetadata uses
        pool.Add(proto)
    problems = _contract_violations(pool)
    assert problems == ["MessageMetadata.attempt_count is (9, 'uint32'), expected (4, 'uint32')"]


def _protoc(out: Path, *extra: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", *extra, *PROTO_FILES],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_committed_stubs_are_generated_from_the_proto_files(tmp_path: Path) -> None:
    descriptor_set = tmp_path / "fila.pb"
    _protoc(tmp_path, f"--descriptor_set_out={descriptor_set}")
    generated = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes())
    by_name = {f.name: _without_json_names(f) for f in generated.file}
    for module in (messages_pb2, service_pb2, admin_pb2):
        committed = descriptor_pb2.FileDescriptorProto.FromString(module.DESCRIPTOR.serialized_pb)
        assert _without_json_names(committed) == by_name[committed.name], committed.name


def _without_json_names(
    proto: descriptor_pb2.FileDescriptorProto,
) -> descriptor_pb2.FileDescriptorProto:
    """protoc fills in `json_name` in descriptor sets but not in generated code."""
    out = descriptor_pb2.FileDescriptorProto()
    out.CopyFrom(proto)
    pending = list(out.message_type)
    while pending:
        message = pending.pop()
        for field in message.field:
            field.ClearField("json_name")
        pending.extend(message.nested_type)
    return out


# ----------------------------------------------------------------------------- (a)

CLIENT_SCRIPT = textwrap.dedent(
    """
    import sys

    GEN = sys.argv[2]
    # Only the freshly generated code may provide fila.v1; the repository must not be
    # importable at all (no fila_sdk, no committed stubs). The dev environment has the
    # repository pip-installed in editable mode, which adds an import hook mapping
    # `fila` and `fila_sdk` to the checkout: take it out, as on a user's machine.
    sys.meta_path[:] = [
        f for f in sys.meta_path
        if not getattr(f, "__module__", "").startswith("__editable__")
        and not getattr(f, "__name__", "").startswith("_Editable")
    ]
    import fila.v1.admin_pb2 as admin_pb2
    import fila.v1.admin_pb2_grpc as admin_pb2_grpc
    import fila.v1.service_pb2 as service_pb2
    import fila.v1.service_pb2_grpc as service_pb2_grpc
    import fila

    for module in (fila, admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc):
        assert module.__file__.startswith(GEN), module.__file__
    REPO = sys.argv[3]
    assert not any(p and p.rstrip("/") == REPO.rstrip("/") for p in sys.path), sys.path
    try:
        import fila_sdk  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("fila_sdk is importable in the proto-only client")

    import grpc

    def messages(stream):
        for frame in stream:
            if frame.HasField("message"):  # skip keepalives
                yield frame.message

    channel = grpc.insecure_channel(sys.argv[1])
    svc = service_pb2_grpc.FilaServiceStub(channel)
    admin = admin_pb2_grpc.FilaAdminStub(channel)
    T = 10

    q = "proto-only"
    reply = admin.CreateQueue(
        admin_pb2.CreateQueueRequest(
            name=q, config=admin_pb2.QueueConfig(visibility_timeout_ms=60000)),
        timeout=T)
    assert reply.queue_id == q, reply
    listing = admin.ListQueues(admin_pb2.ListQueuesRequest(), timeout=T)
    names = sorted(i.name for i in listing.queues)
    assert names == [q, q + ".dlq"], names
    assert listing.cluster_node_count == 1, listing

    first = svc.Enqueue(service_pb2.EnqueueRequest(
        queue=q, headers={"k": "v"}, payload=b"one"), timeout=T).message_id
    second = svc.Enqueue(service_pb2.EnqueueRequest(queue=q, payload=b"two"), timeout=T).message_id
    stats = admin.GetStats(admin_pb2.GetStatsRequest(queue=q), timeout=T)
    assert (stats.depth, stats.in_flight) == (2, 0), stats

    call = svc.Consume(service_pb2.ConsumeRequest(queue=q), timeout=T)
    stream = messages(call)
    m = next(stream)
    assert (m.id, m.payload, dict(m.headers)) == (first, b"one", {"k": "v"}), m
    assert (m.metadata.queue_id, m.metadata.fairness_key, m.metadata.weight) == (q, "default", 1)
    assert m.metadata.attempt_count == 0
    assert m.timestamps.enqueued_at.seconds > 0 and m.timestamps.leased_at.seconds > 0
    svc.Ack(service_pb2.AckRequest(queue=q, message_id=first), timeout=T)

    m = next(stream)
    assert (m.id, m.metadata.attempt_count) == (second, 0), m
    svc.Nack(service_pb2.NackRequest(queue=q, message_id=second, error="try again"), timeout=T)
    m = next(stream)
    assert (m.id, m.metadata.attempt_count, m.payload) == (second, 1, b"two"), m
    svc.Ack(service_pb2.AckRequest(queue=q, message_id=second), timeout=T)
    call.cancel()

    stats = admin.GetStats(admin_pb2.GetStatsRequest(queue=q), timeout=T)
    assert (stats.depth, stats.in_flight) == (0, 0), stats
    admin.DeleteQueue(admin_pb2.DeleteQueueRequest(queue=q), timeout=T)
    names = [i.name for i in admin.ListQueues(admin_pb2.ListQueuesRequest(), timeout=T).queues]
    assert names == [], names
    try:
        admin.GetStats(admin_pb2.GetStatsRequest(queue=q), timeout=T)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc
    else:
        raise AssertionError("GetStats of a deleted queue succeeded")
    print("LIFECYCLE OK")
    """
)


def test_client_generated_from_proto_files_only(server: ServerProcess, tmp_path: Path) -> None:
    gen = tmp_path / "gen"
    _protoc(gen, f"--python_out={gen}", f"--grpc_python_out={gen}")
    for package in (gen / "fila", gen / "fila" / "v1"):
        (package / "__init__.py").touch()  # regular packages win over any other `fila`
    script = gen / "client.py"
    script.write_text(CLIENT_SCRIPT, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "FILA_"))}
    env["PYTHONPATH"] = str(gen)
    done = subprocess.run(
        # -P: do not put the script's or current directory first; -s: no user site.
        [sys.executable, "-P", "-s", str(script), server.addr, str(gen), str(REPO_ROOT)],
        cwd=gen,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    assert "LIFECYCLE OK" in done.stdout


# ----------------------------------------------------------------------------- (c)


def test_health_reports_serving(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.addr) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        for service in ("", "fila.v1.FilaService", "fila.v1.FilaAdmin"):
            reply = check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as unknown:
            check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_and_describes_both_services(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.addr) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"fila.v1.FilaService", "fila.v1.FilaAdmin", "grpc.health.v1.Health"} <= services
        # What the running broker serves by reflection is the contract too
        # (this is what `grpcurl` without proto files sees).
        pool = descriptor_pool.DescriptorPool(database)
        assert _contract_violations(pool) == []
