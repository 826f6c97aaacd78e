"""API keys and ACLs (SPEC 3, issue 8) against real broker processes.

Most tests share one auth-enabled broker (module scope) and keep to their own
queue names and keys; tests that restart, kill or read the broker's log start their
own. Every client here connects from 127.0.0.1, and the broker slows down hosts
that keep failing authentication, so tests that send many wrong keys use a broker
of their own.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from queue import Queue
from typing import Any

import grpc
import grpc.aio
import pytest
from click.testing import CliRunner, Result
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from support import ServerFactory, unique, wait_until

from fila.cli import cli
from fila.clock import ManualClock
from fila.core.errors import InvalidArgument, Unavailable
from fila.security.acl import Kind, Pattern, Permission, may_delegate
from fila.security.apikeys import fingerprint
from fila.security.failures import (
    FREE_FAILURES,
    MAX_DELAY_S,
    MAX_HELD,
    MAX_PEERS,
    FailureGuard,
)
from fila.security.keyring import BOOTSTRAP_NAME, Keyring, Refusal
from fila.security.keystore import LocalKeyStore, StoredKeys
from fila.server.access import RULES, Scope
from fila.server.auth import AuthInterceptor
from fila.storage.backend import MemoryStorage, RocksStorage
from fila.storage.committer import Committer
from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc
from fila_sdk import (
    AclPermission,
    ApiKeyNotFoundError,
    AsyncClient,
    Client,
    CreatedApiKey,
    InvalidArgumentError,
    MessageNotFoundError,
    PermissionDeniedError,
    QueueAlreadyExistsError,
    UnauthenticatedError,
)

BOOT = "boot-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("secured")
    with ServerProcess(root / "data", env={"FILA_BOOTSTRAP_APIKEY": BOOT}) as srv:
        yield srv


@pytest.fixture
def admin(secured: ServerProcess) -> Iterator[Client]:
    with Client(secured.addr, api_key=BOOT) as client:
        yield client


def new_key(admin: Client, *permissions: str, superadmin: bool = False) -> CreatedApiKey:
    created = admin.create_api_key(unique("key"), superadmin=superadmin)
    if permissions:
        admin.set_acl(created.key_id, permissions)
    return created


def as_key(server: ServerProcess, key: CreatedApiKey | str) -> Client:
    return Client(server.addr, api_key=key if isinstance(key, str) else key.key, timeout=30)


def queue_names(client: Client) -> set[str]:
    return {q.name for q in client.list_queues()}


# --- Pattern semantics (no broker) -------------------------------------------------------


def test_patterns_cover_exact_prefix_any_and_dlq() -> None:
    exact, prefix, anything = Pattern.parse("orders"), Pattern.parse("acme.*"), Pattern.parse("*")
    assert exact.covers("orders") and exact.covers("orders.dlq")
    assert not exact.covers("orders2") and not exact.covers("orders.x")
    assert prefix.covers("acme.a") and prefix.covers("acme.a.b") and prefix.covers("acme.a.dlq")
    assert not prefix.covers("acme") and not prefix.covers("acmex.a") and not prefix.covers("x")
    assert not prefix.covers("acme.dlq")  # the DLQ of "acme", which acme.* does not cover
    assert anything.covers("whatever.dlq")
    for bad in ("", "orders*", "*.x", ".*", "a.*.*", "bad name", "é", "acme.**", " *"):
        with pytest.raises(InvalidArgument, match="malformed"):
            Pattern.parse(bad)
    with pytest.raises(InvalidArgument, match='unknown ACL kind "write"'):
        Permission.parse("write", "orders")


def test_delegation_stays_inside_admin_patterns() -> None:
    def inside(domain: str, pattern: str) -> bool:
        return may_delegate([Pattern.parse(domain)], Permission.parse("produce", pattern))

    assert inside("*", "*") and inside("*", "x.*") and inside("*", "x")
    assert inside("acme.*", "acme.*") and inside("acme.*", "acme.eu.*")
    assert inside("acme.*", "acme.orders") and inside("acme.*", "acme.orders.dlq")
    assert not inside("acme.*", "*") and not inside("acme.*", "acme")
    assert not inside("acme.*", "acmex.*") and not inside("acme.*", "globex.orders")
    assert not inside("acme.*", "acme.dlq")
    assert inside("orders", "orders") and inside("orders", "orders.dlq")
    assert not inside("orders", "orders.*") and not inside("orders", "*")
    assert not inside("orders.dlq", "orders")


def test_rules_cover_every_rpc_with_the_spec_kind() -> None:
    """Every method of both services has a rule (a missing one would be superadmin-only),
    queue rules read a field their unary request has, and kinds follow SPEC 3."""
    services = [
        service
        for module in (service_pb2, admin_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
    ]
    methods = {f"/{s.full_name}/{m.name}": m for s in services for m in s.methods}
    assert set(RULES) == set(methods)
    for name, rule in RULES.items():
        if rule.scope is Scope.QUEUE:
            method = methods[name]
            assert not method.client_streaming, name
            assert method.input_type.fields_by_name[rule.field].type == 9, name  # string
    expected = {
        Kind.PRODUCE: {"Enqueue", "EnqueueBatch", "StreamEnqueue"},
        Kind.CONSUME: {
            "Consume",
            "StreamConsume",
            "Ack",
            "Nack",
            "AckBatch",
            "NackBatch",
            "ExtendLease",
        },
        Kind.ADMIN: {
            "CreateQueue",
            "DeleteQueue",
            "GetStats",
            "Redrive",
            "PeekMessages",
            "PurgeQueue",
            "GetQueue",
            "UpdateQueue",
            "SetConfig",
            "GetConfig",
            "ListConfig",
            "ClusterStatus",  # SPEC 9: an operator's view of the cluster, like config
        },
    }
    for kind, names in expected.items():
        assert {n.rsplit("/", 1)[1] for n, r in RULES.items() if r.kind is kind} == names
    for batch in ("EnqueueBatch", "StreamEnqueue", "AckBatch", "NackBatch", "StreamConsume"):
        assert RULES[f"/fila.v1.FilaService/{batch}"].scope is Scope.EACH_ITEM


def test_failure_guard_delays_forgives_and_stays_bounded() -> None:
    now = [0.0]
    guard = FailureGuard(lambda: now[0], jitter=lambda: 0.0)
    delays = [guard.failed("ipv4:10.0.0.1").delay_s for _ in range(12)]
    assert delays[:FREE_FAILURES] == [0.0] * FREE_FAILURES  # a misconfigured client: fast errors
    assert delays[FREE_FAILURES:9] == [0.05, 0.1, 0.2, 0.4]
    assert delays[-1] == MAX_DELAY_S
    assert guard.failed("ipv4:10.0.0.2").delay_s == 0.0  # counted per host
    spread = FailureGuard(lambda: now[0], jitter=lambda: 0.999)
    late = [spread.failed("ipv4:10.0.0.3").delay_s for _ in range(20)][-1]
    assert MAX_DELAY_S * 0.5 < late < MAX_DELAY_S * 0.51  # held calls do not come due together
    now[0] += 60.0  # forgiven at LEAK_PER_S
    assert guard.failed("ipv4:10.0.0.1").delay_s == 0.0
    for _ in range(guard.held):
        guard.released()
    hosts = [f"ipv4:10.1.{i // 256}.{i % 256}" for i in range(MAX_PEERS + 100)]
    for host in hosts:
        guard.failed(host)
    assert len(guard._scores) == MAX_PEERS  # least recently failing hosts dropped
    busy = FailureGuard(lambda: now[0])
    held = [busy.failed("ipv4:10.0.0.9").delay_s for _ in range(MAX_HELD + FREE_FAILURES + 10)]
    assert busy.held == MAX_HELD and held[-1] == 0.0  # past the bound: answered at once
    logged = [busy.failed("ipv4:10.0.0.9") for _ in range(5)]
    assert not any(v.log for v in logged)  # the log bucket is long empty


# --- The ACL matrix ------------------------------------------------------------------------


@dataclass
class As:
    """One key's view of the broker: `fila_sdk` for the unary RPCs, the raw stubs (with
    the key's metadata) for the batch and stream RPCs the published SDKs do not have."""

    sdk: Client
    svc: service_pb2_grpc.FilaServiceStub
    admin: admin_pb2_grpc.FilaAdminStub
    md: tuple[tuple[str, str], ...]


@contextmanager
def as_key_raw(server: ServerProcess, key: CreatedApiKey) -> Iterator[As]:
    with as_key(server, key) as sdk, grpc.insecure_channel(server.addr) as channel:
        md = (("authorization", f"Bearer {key.key}"),)
        yield As(
            sdk,
            service_pb2_grpc.FilaServiceStub(channel),
            admin_pb2_grpc.FilaAdminStub(channel),
            md,
        )


def _denied_as_error(err: grpc.RpcError | service_pb2.BatchError) -> None:
    """A refusal, as a call's status or as a batch item's error, becomes the SDK's
    PermissionDeniedError; any other failure passes through untouched."""
    if isinstance(err, service_pb2.BatchError):
        if err.kind == "permission_denied":
            raise PermissionDeniedError(err.message, grpc.StatusCode.PERMISSION_DENIED)
        return
    if err.code() == grpc.StatusCode.PERMISSION_DENIED:
        raise PermissionDeniedError(err.details() or "", grpc.StatusCode.PERMISSION_DENIED)
    raise err


def _enqueue(who: As, queue: str) -> None:
    who.sdk.enqueue(queue, None, b"matrix")


def _consume(who: As, queue: str) -> None:
    stream = who.sdk.consume(queue)
    try:
        assert next(stream).payload == b"seed"
    finally:
        stream.close()


def _ack(who: As, queue: str) -> None:
    with pytest.raises(MessageNotFoundError):  # past the ACL: the id is simply not leased
        who.sdk.ack(queue, str(uuid.uuid4()))


def _nack(who: As, queue: str) -> None:
    with pytest.raises(MessageNotFoundError):
        who.sdk.nack(queue, str(uuid.uuid4()), "boom")


def _create_queue(who: As, queue: str) -> None:
    with pytest.raises(QueueAlreadyExistsError):  # past the ACL: the fixture made it
        who.sdk.create_queue(queue)


def _delete_queue(who: As, queue: str) -> None:
    who.sdk.delete_queue(queue)


def _get_stats(who: As, queue: str) -> None:
    assert who.sdk.get_stats(queue).depth >= 0


def _redrive(who: As, queue: str) -> None:
    assert who.sdk.redrive(queue + ".dlq") == 0  # the DLQ is covered by its queue's pattern


def _enqueue_batch(who: As, queue: str) -> None:
    request = service_pb2.EnqueueBatchRequest(
        messages=[service_pb2.EnqueueRequest(queue=queue, payload=b"batch")]
    )
    (result,) = who.svc.EnqueueBatch(request, metadata=who.md, timeout=10).results
    _denied_as_error(result.error)
    assert result.message_id


def _stream_enqueue(who: As, queue: str) -> None:
    request = service_pb2.StreamEnqueueRequest(
        sequence_number=7, messages=[service_pb2.EnqueueRequest(queue=queue, payload=b"s")]
    )
    answers = who.svc.StreamEnqueue(iter([request]), metadata=who.md, timeout=10)
    (answer,) = list(answers)
    (result,) = answer.results
    _denied_as_error(result.error)
    assert answer.sequence_number == 7 and result.message_id


def _ack_batch(who: As, queue: str) -> None:
    request = service_pb2.AckBatchRequest(
        acks=[service_pb2.AckRequest(queue=queue, message_id=str(uuid.uuid4()))]
    )
    (result,) = who.svc.AckBatch(request, metadata=who.md, timeout=10).results
    _denied_as_error(result)
    assert result.kind == "message_not_found"


def _nack_batch(who: As, queue: str) -> None:
    request = service_pb2.NackBatchRequest(
        nacks=[service_pb2.NackRequest(queue=queue, message_id=str(uuid.uuid4()))]
    )
    (result,) = who.svc.NackBatch(request, metadata=who.md, timeout=10).results
    _denied_as_error(result)
    assert result.kind == "message_not_found"


def _stream_consume(who: As, queue: str) -> None:
    opening = service_pb2.StreamConsumeRequest(queue=queue)
    # The request side stays open until the message is read: a half-close ends the
    # stream with OK (docs/api.md), and could reach the broker before the delivery.
    done = threading.Event()

    def requests() -> Iterator[service_pb2.StreamConsumeRequest]:
        yield opening
        done.wait(10)

    stream = who.svc.StreamConsume(requests(), metadata=who.md, timeout=10)
    try:
        frame = next(stream)
        while not frame.HasField("message"):  # keepalives
            frame = next(stream)
        assert frame.message.payload == b"seed"
    except grpc.RpcError as err:
        _denied_as_error(err)
    finally:
        done.set()
        stream.cancel()


def _extend_lease(who: As, queue: str) -> None:
    request = service_pb2.ExtendLeaseRequest(queue=queue, message_id=str(uuid.uuid4()))
    try:
        who.svc.ExtendLease(request, metadata=who.md, timeout=10)
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: past the ACL
            _denied_as_error(err)
    else:
        raise AssertionError("extending an unknown lease must fail")


def _peek(who: As, queue: str) -> None:
    request = admin_pb2.PeekMessagesRequest(queue=queue)
    try:
        peeked = who.admin.PeekMessages(request, metadata=who.md, timeout=10)
    except grpc.RpcError as err:
        _denied_as_error(err)
    assert [m.payload for m in peeked.messages] == [b"seed"]


def _purge(who: As, queue: str) -> None:
    request = admin_pb2.PurgeQueueRequest(queue=queue)
    try:
        purged = who.admin.PurgeQueue(request, metadata=who.md, timeout=10)
    except grpc.RpcError as err:
        _denied_as_error(err)
    assert purged.purged == 1


def _get_queue(who: As, queue: str) -> None:
    request = admin_pb2.GetQueueRequest(queue=queue)
    try:
        details = who.admin.GetQueue(request, metadata=who.md, timeout=10)
    except grpc.RpcError as err:
        _denied_as_error(err)
    assert details.name == queue


def _update_queue(who: As, queue: str) -> None:
    request = admin_pb2.UpdateQueueRequest(
        queue=queue,
        config=admin_pb2.QueueConfig(visibility_timeout_ms=45_000),
        update_mask=["visibility_timeout_ms"],
    )
    try:
        updated = who.admin.UpdateQueue(request, metadata=who.md, timeout=10)
    except grpc.RpcError as err:
        _denied_as_error(err)
    assert updated.config.visibility_timeout_ms == 45_000


@dataclass(frozen=True)
class Op:
    """One RPC as a matrix row: `run` returns when allowed, raises PermissionDeniedError
    when not."""

    rpc: str
    kind: Kind
    run: Callable[[As, str], None]


OPS = [
    Op("Enqueue", Kind.PRODUCE, _enqueue),
    Op("EnqueueBatch", Kind.PRODUCE, _enqueue_batch),
    Op("StreamEnqueue", Kind.PRODUCE, _stream_enqueue),
    Op("Consume", Kind.CONSUME, _consume),
    Op("StreamConsume", Kind.CONSUME, _stream_consume),
    Op("Ack", Kind.CONSUME, _ack),
    Op("Nack", Kind.CONSUME, _nack),
    Op("AckBatch", Kind.CONSUME, _ack_batch),
    Op("NackBatch", Kind.CONSUME, _nack_batch),
    Op("ExtendLease", Kind.CONSUME, _extend_lease),
    Op("CreateQueue", Kind.ADMIN, _create_queue),
    Op("DeleteQueue", Kind.ADMIN, _delete_queue),
    Op("GetStats", Kind.ADMIN, _get_stats),
    Op("Redrive", Kind.ADMIN, _redrive),
    Op("PeekMessages", Kind.ADMIN, _peek),
    Op("PurgeQueue", Kind.ADMIN, _purge),
    Op("GetQueue", Kind.ADMIN, _get_queue),
    Op("UpdateQueue", Kind.ADMIN, _update_queue),
]


def _shape(shape: str, tenant: str) -> tuple[str, str, str | None]:
    """(pattern, a queue it covers, a queue it does not cover)."""
    if shape == "exact":
        return f"{tenant}-q", f"{tenant}-q", f"{tenant}-q2"
    if shape == "prefix":
        return f"{tenant}.*", f"{tenant}.q", tenant
    return "*", f"{tenant}-any", None


def test_acl_matrix_names_every_queue_rpc() -> None:
    """Each RPC that acts on a queue has a matrix row, so a new one cannot go untested."""
    queue_rpcs = {
        name.rsplit("/", 1)[1]
        for name, rule in RULES.items()
        if rule.scope in (Scope.QUEUE, Scope.EACH_ITEM)
    }
    assert {op.rpc for op in OPS} == queue_rpcs


@pytest.mark.parametrize("shape", ["exact", "prefix", "star"])
@pytest.mark.parametrize("op", OPS, ids=lambda op: op.rpc)
def test_acl_matrix(admin: Client, secured: ServerProcess, op: Op, shape: str) -> None:
    pattern, inside, outside = _shape(shape, unique("t"))
    for queue in (inside, outside):
        if queue is not None:
            admin.create_queue(queue)
            admin.enqueue(queue, None, b"seed")
    holder = new_key(admin, f"{op.kind}:{pattern}")
    others = new_key(admin, *(f"{k}:{pattern}" for k in Kind if k is not op.kind))
    before = {q.name: q.depth for q in admin.list_queues()}
    with as_key_raw(secured, holder) as client, as_key_raw(secured, others) as other:
        if outside is not None:
            with pytest.raises(PermissionDeniedError, match=f'{op.kind} permission on queue "'):
                op.run(client, outside)
        with pytest.raises(PermissionDeniedError):
            op.run(other, inside)
        # Denied calls changed nothing (no message, no queue created or deleted).
        assert {q.name: q.depth for q in admin.list_queues()} == before
        op.run(client, inside)


def test_batch_items_outside_the_acl_fail_alone(admin: Client, secured: ServerProcess) -> None:
    mine, theirs = unique("mine"), unique("theirs")
    for queue in (mine, theirs):
        admin.create_queue(queue)
    key = new_key(admin, f"produce:{mine}", f"consume:{mine}")
    with as_key_raw(secured, key) as who:
        items = [service_pb2.EnqueueRequest(queue=q, payload=b"x") for q in (mine, theirs, mine)]
        reply = who.svc.EnqueueBatch(
            service_pb2.EnqueueBatchRequest(messages=items), metadata=who.md, timeout=10
        )
        kinds = [r.error.kind or "stored" for r in reply.results]
        assert kinds == ["stored", "permission_denied", "stored"]
        assert theirs in reply.results[1].error.message
        acks = [
            service_pb2.AckRequest(queue=q, message_id=str(uuid.uuid4())) for q in (theirs, mine)
        ]
        acked = who.svc.AckBatch(
            service_pb2.AckBatchRequest(acks=acks), metadata=who.md, timeout=10
        )
        assert [r.kind for r in acked.results] == ["permission_denied", "message_not_found"]
    assert admin.get_stats(mine).depth == 2 and admin.get_stats(theirs).depth == 0


def test_new_key_has_no_permissions(admin: Client, secured: ServerProcess) -> None:
    queue = unique("fresh")
    admin.create_queue(queue)
    admin.enqueue(queue, None, b"seed")
    key = new_key(admin)
    with as_key_raw(secured, key) as who:
        assert who.sdk.get_acl(key.key_id).permissions == ()  # its own ACL is readable
        assert queue_names(who.sdk) == set()
        for op in OPS:
            with pytest.raises(PermissionDeniedError):
                op.run(who, queue)
        with pytest.raises(PermissionDeniedError):
            who.sdk.list_config()


def test_config_needs_admin_on_every_queue(admin: Client, secured: ServerProcess) -> None:
    narrow = new_key(admin, "admin:acme.*", "produce:*")
    wide = new_key(admin, "admin:*")
    with as_key(secured, narrow) as client:
        for call in (
            lambda: client.set_config("throttle.x", "1,1"),
            lambda: client.get_config("throttle.x"),
            lambda: client.list_config(),
        ):
            with pytest.raises(PermissionDeniedError, match='admin permission on "\\*"'):
                call()
    with as_key(secured, wide) as client:
        name = unique("cfg")
        client.set_config(name, "v")
        assert client.get_config(name) == "v"
        assert client.list_config(name).total_count == 1


def test_list_queues_shows_only_what_the_key_may_see(admin: Client, secured: ServerProcess) -> None:
    tenant = unique("ten")
    mine = [f"{tenant}.a", f"{tenant}.b", f"{tenant}-solo"]
    theirs = [f"{tenant}-other", unique("globex")]
    for queue in mine + theirs:
        admin.create_queue(queue)
    key = new_key(admin, f"produce:{tenant}.*", f"consume:{tenant}-solo")
    with as_key(secured, key) as client:
        assert queue_names(client) == {*mine, *(q + ".dlq" for q in mine)}
    everything = queue_names(admin)
    for wide in (new_key(admin, "admin:*"), new_key(admin, superadmin=True)):
        with as_key(secured, wide) as client:
            assert queue_names(client) == everything


def test_dlq_is_covered_by_its_queue(admin: Client, secured: ServerProcess) -> None:
    queue = unique("dl")
    admin.create_queue(queue, on_failure='function on_failure(m) return {action="dlq"} end')
    admin.enqueue(queue, None, b"poison")
    stream = admin.consume(queue)
    admin.nack(queue, next(stream).id, "fatal")
    stream.close()
    consumer = new_key(admin, f"consume:{queue}")
    dlq_only = new_key(admin, f"consume:{queue}.dlq")
    with as_key(secured, consumer) as client:
        dead = client.consume(f"{queue}.dlq")
        message = next(dead)
        assert message.payload == b"poison"
        client.ack(f"{queue}.dlq", message.id)
        dead.close()
    with as_key_raw(secured, dlq_only) as who, pytest.raises(PermissionDeniedError):
        _consume(who, queue)
    with as_key_raw(secured, dlq_only) as who, pytest.raises(PermissionDeniedError):
        _ack(who, queue)


def test_bad_acl_is_invalid_argument_and_changes_nothing(
    admin: Client, secured: ServerProcess
) -> None:
    key = new_key(admin, "produce:orders")
    for bad in (
        ["write:orders"],
        ["Produce:orders"],
        ["produce:orders", "consume:orders*"],
        ["produce:bad name"],
        ["produce:*.orders"],
        ["admin:"],
    ):
        with pytest.raises(InvalidArgumentError):
            admin.set_acl(key.key_id, [AclPermission(*p.split(":", 1)) for p in bad])
        assert admin.get_acl(key.key_id).permissions == (AclPermission("produce", "orders"),)
    with pytest.raises(InvalidArgumentError):
        admin.get_acl("")
    with pytest.raises(ApiKeyNotFoundError):
        admin.set_acl("0000000000000000", ["produce:x"])
    with pytest.raises(ApiKeyNotFoundError):
        admin.revoke_api_key("0000000000000000")
    with pytest.raises(InvalidArgumentError):
        admin.create_api_key("")
    past = datetime.now(UTC) - timedelta(seconds=5)
    with pytest.raises(InvalidArgumentError, match="not in the future"):
        admin.create_api_key(unique("late"), expires_at=past)


# --- Delegation and key management -------------------------------------------------------------


def test_delegation_rule(admin: Client, secured: ServerProcess) -> None:
    tenant = unique("acme")
    admin.create_queue(f"{tenant}.orders")
    tenant_admin = new_key(admin, f"admin:{tenant}.*", "produce:elsewhere")
    fresh = new_key(admin)
    foreign = new_key(admin, f"produce:{tenant}.orders", "produce:globex")
    boss = new_key(admin, superadmin=True)
    producer_only = new_key(admin, "produce:*")
    grant = [f"produce:{tenant}.orders", f"consume:{tenant}.*", f"admin:{tenant}.eu.*"]
    with as_key(secured, tenant_admin) as ta:
        ta.set_acl(fresh.key_id, grant)
        assert [str(p) for p in ta.get_acl(fresh.key_id).permissions] == grant
        for outside in ("produce:*", "produce:globex", f"consume:{tenant}", "admin:*"):
            with pytest.raises(PermissionDeniedError, match="not inside its admin patterns"):
                ta.set_acl(fresh.key_id, [f"produce:{tenant}.x", outside])
        assert [str(p) for p in admin.get_acl(fresh.key_id).permissions] == grant
        # Keys it does not manage (one holding a grant outside its domain, a superadmin,
        # an id that does not exist) get one refusal, which reveals nothing about them.
        refusals = set()
        for key_id in (foreign.key_id, boss.key_id, "0123456789abcdef"):
            with pytest.raises(PermissionDeniedError) as refused:
                ta.get_acl(key_id)
            refusals.add(str(refused.value).replace(key_id, "<id>"))
        assert len(refusals) == 1, refusals
        assert "globex" not in refusals.pop()
        with pytest.raises(PermissionDeniedError, match="not a key within its admin patterns"):
            ta.set_acl(foreign.key_id, [f"produce:{tenant}.orders"])
        with pytest.raises(PermissionDeniedError, match="not a key within its admin patterns"):
            ta.set_acl(boss.key_id, [f"produce:{tenant}.orders"])
        # Its own ACL is readable, but it cannot widen itself beyond its admin patterns.
        assert ta.get_acl(tenant_admin.key_id).permissions[0] == AclPermission(
            "admin", f"{tenant}.*"
        )
        with pytest.raises(PermissionDeniedError):
            ta.set_acl(tenant_admin.key_id, ["admin:*"])
        # The tenant admin administers its queues, not others.
        ta.create_queue(f"{tenant}.new")
        with pytest.raises(PermissionDeniedError):
            ta.create_queue(unique("globex"))
    with as_key(secured, fresh) as client:
        client.enqueue(f"{tenant}.orders", None, b"granted by the tenant admin")
    with as_key(secured, producer_only) as client:
        with pytest.raises(PermissionDeniedError, match="no admin permission"):
            client.set_acl(fresh.key_id, [f"produce:{tenant}.orders"])
        with pytest.raises(PermissionDeniedError):
            client.get_acl(fresh.key_id)


def test_only_superadmins_manage_keys(admin: Client, secured: ServerProcess) -> None:
    victim = new_key(admin)
    for holder in (new_key(admin, "admin:*", "produce:*", "consume:*"), new_key(admin)):
        with as_key(secured, holder) as client:
            with pytest.raises(PermissionDeniedError, match="only superadmin"):
                client.create_api_key(unique("sneaky"), superadmin=True)
            with pytest.raises(PermissionDeniedError, match="only superadmin"):
                client.list_api_keys()
            with pytest.raises(PermissionDeniedError, match="only superadmin"):
                client.revoke_api_key(victim.key_id)
    assert victim.key_id in {k.key_id for k in admin.list_api_keys()}
    boss = new_key(admin, superadmin=True)
    assert boss.is_superadmin
    with as_key(secured, boss) as client:
        made = client.create_api_key(unique("made-by-boss"))
        listed = {k.key_id: k for k in client.list_api_keys()}
        assert listed[boss.key_id].is_superadmin and not listed[made.key_id].is_superadmin
        assert listed[made.key_id].expires_at is None
        client.revoke_api_key(victim.key_id)
        assert client.get_acl(boss.key_id).is_superadmin
    assert victim.key_id not in {k.key_id for k in admin.list_api_keys()}


def test_created_key_is_random_shown_once_and_stored_hashed(server_factory: ServerFactory) -> None:
    srv = server_factory(env={"FILA_BOOTSTRAP_APIKEY": BOOT, "FILA_LOG_LEVEL": "DEBUG"})
    queue = unique("h")
    with Client(srv.addr, api_key=BOOT) as admin:
        admin.create_queue(queue)
        keys = [admin.create_api_key(unique("k")) for _ in range(3)]
        admin.set_acl(keys[0].key_id, [f"produce:{queue}"])
        listing = admin.list_api_keys()
    assert len({k.key for k in keys}) == 3
    for key in keys:
        assert key.key.startswith("fila_") and len(key.key) >= len("fila_") + 43  # 256 bits
        assert key.key not in repr(key) and key.key not in repr(listing)
    with as_key(srv, keys[0]) as client:
        client.enqueue(queue, None, b"x")
        with pytest.raises(PermissionDeniedError) as denied:
            client.enqueue(unique("other"), None, b"x")
    with Client(srv.addr, api_key=BOOT) as admin:
        admin.revoke_api_key(keys[0].key_id)
    with as_key(srv, keys[0]) as client, pytest.raises(UnauthenticatedError) as refused:
        client.enqueue(queue, None, b"x")
    srv.stop()
    for err in (denied.value, refused.value):
        assert keys[0].key not in err.message
    # Read back through RocksDB, not the raw files: SST blocks are compressed, so a
    # byte search of the files can miss a stored plaintext (or a stored hash).
    storage = RocksStorage(srv.data_dir)
    try:
        records = (kv for first in range(0xFF) for kv in storage.scan(bytes([first])))
        stored = b"\n".join(k + b"\n" + v for k, v in records)
    finally:
        storage.close()
    log = srv.log_text()
    for key in keys:
        assert key.key.encode() not in stored
        assert key.key not in log
    assert hashlib.sha256(keys[1].key.encode()).hexdigest().encode() in stored


# --- Expiry, revocation, durability -----------------------------------------------------------


def test_expired_key_is_refused_and_its_stream_ends(admin: Client, secured: ServerProcess) -> None:
    queue = unique("exp")
    admin.create_queue(queue)
    expires_at = datetime.now(UTC) + timedelta(seconds=2)
    key = admin.create_api_key(unique("short"), expires_at=expires_at)
    admin.set_acl(key.key_id, [f"consume:{queue}", f"produce:{queue}"])
    listed = {k.key_id: k for k in admin.list_api_keys()}[key.key_id]
    assert listed.expires_at is not None
    assert abs((listed.expires_at - expires_at).total_seconds()) < 0.01

    async def scenario() -> None:
        async with AsyncClient(secured.addr, api_key=key.key) as client:
            await client.enqueue(queue, None, b"before expiry")
            stream = client.consume(queue)
            assert (await anext(stream)).payload == b"before expiry"
            # The broker ends the open stream when the key expires.
            with pytest.raises(UnauthenticatedError, match="expired"):
                await asyncio.wait_for(anext(stream), 10)
            assert datetime.now(UTC) >= expires_at - timedelta(milliseconds=50)
            with pytest.raises(UnauthenticatedError, match="expired"):
                await client.enqueue(queue, None, b"after expiry")

    asyncio.run(scenario())
    assert admin.get_stats(queue).depth == 0  # the refused enqueue stored nothing
    assert key.key_id in {k.key_id for k in admin.list_api_keys()}  # listed until revoked


def test_revocation_ends_open_consume_stream(admin: Client, secured: ServerProcess) -> None:
    queue = unique("rev")
    admin.create_queue(queue)
    key = new_key(admin, f"consume:{queue}")
    bystander = new_key(admin, f"consume:{queue}")
    admin.enqueue(queue, None, b"one")

    async def scenario() -> None:
        async with (
            AsyncClient(secured.addr, api_key=key.key) as client,
            AsyncClient(secured.addr, api_key=bystander.key) as other,
        ):
            stream = client.consume(queue)
            assert (await anext(stream)).payload == b"one"
            survivor = other.consume(queue)
            pending = asyncio.ensure_future(anext(survivor))
            await asyncio.sleep(0.2)  # both streams are open and idle
            started = time.monotonic()
            await asyncio.to_thread(admin.revoke_api_key, key.key_id)
            with pytest.raises(UnauthenticatedError, match="revoked"):
                await asyncio.wait_for(anext(stream), 5)
            assert time.monotonic() - started < 1.0
            with pytest.raises(UnauthenticatedError):
                await client.ack(queue, str(uuid.uuid4()))
            # Another key's stream on the same queue is untouched.
            await asyncio.to_thread(admin.enqueue, queue, None, b"two")
            assert (await asyncio.wait_for(pending, 5)).payload == b"two"
            await survivor.aclose()

    asyncio.run(scenario())


def test_revocation_ends_the_batch_streams(admin: Client, secured: ServerProcess) -> None:
    """StreamConsume ends at once; StreamEnqueue refuses its next request and ends."""
    queue = unique("revs")
    admin.create_queue(queue)
    key = new_key(admin, f"consume:{queue}", f"produce:{queue}")
    admin.enqueue(queue, None, b"one")
    md = (("authorization", f"Bearer {key.key}"),)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(secured.addr) as channel:
            svc = service_pb2_grpc.FilaServiceStub(channel)
            consuming = svc.StreamConsume(metadata=md)
            await consuming.write(service_pb2.StreamConsumeRequest(queue=queue))
            first = await asyncio.wait_for(consuming.read(), 5)
            assert first.message.payload == b"one"
            producing = svc.StreamEnqueue(metadata=md)
            message = service_pb2.EnqueueRequest(queue=queue, payload=b"two")
            await producing.write(
                service_pb2.StreamEnqueueRequest(sequence_number=1, messages=[message])
            )
            assert (await asyncio.wait_for(producing.read(), 5)).results[0].message_id
            started = time.monotonic()
            await asyncio.to_thread(admin.revoke_api_key, key.key_id)
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while True:  # keepalives aside, the next thing is the end of the stream
                    await asyncio.wait_for(consuming.read(), 5)
            assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() - started < 1.0
            await producing.write(
                service_pb2.StreamEnqueueRequest(sequence_number=2, messages=[message])
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                while True:
                    await asyncio.wait_for(producing.read(), 5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(scenario())
    # "one" went back to the queue with the ended stream; only "two" was stored after it.
    assert admin.get_stats(queue).depth == 2


def test_keys_and_acls_survive_restart_and_kill_9(server_factory: ServerFactory) -> None:
    srv = server_factory(env={"FILA_BOOTSTRAP_APIKEY": BOOT})
    queue = unique("dur")
    with Client(srv.addr, api_key=BOOT) as admin:
        admin.create_queue(queue)
        kept = new_key(admin, f"produce:{queue}")
        revoked = new_key(admin, f"produce:{queue}")
        admin.revoke_api_key(revoked.key_id)
        changed = new_key(admin, f"produce:{queue}")
        admin.set_acl(changed.key_id, [f"consume:{queue}"])
    srv.restart()

    def check(client_key: CreatedApiKey, allowed: bool) -> None:
        with as_key(srv, client_key) as client:
            if allowed:
                client.enqueue(queue, None, b"x")
            else:
                with pytest.raises(PermissionDeniedError):
                    client.enqueue(queue, None, b"x")

    check(kept, True)
    check(changed, False)
    with as_key(srv, revoked) as client, pytest.raises(UnauthenticatedError):
        client.enqueue(queue, None, b"x")
    with Client(srv.addr, api_key=BOOT) as admin:
        assert [str(p) for p in admin.get_acl(changed.key_id).permissions] == [f"consume:{queue}"]
        late = new_key(admin, f"produce:{queue}")  # answered, so durable...
        admin.revoke_api_key(kept.key_id)
    srv.kill()  # ...even across a kill -9 right after the answers
    srv.start()
    check(late, True)
    with as_key(srv, kept) as client, pytest.raises(UnauthenticatedError):
        client.enqueue(queue, None, b"x")
    with Client(srv.addr, api_key=BOOT) as admin:
        assert {late.key_id, changed.key_id} <= {k.key_id for k in admin.list_api_keys()}


# --- Authentication at the edge -------------------------------------------------------------


def _raw_enqueue(addr: str, queue: str, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    with grpc.insecure_channel(addr) as channel:
        stub = service_pb2_grpc.FilaServiceStub(channel)
        try:
            stub.Enqueue(
                service_pb2.EnqueueRequest(queue=queue, payload=b"x"), metadata=metadata, timeout=10
            )
        except grpc.RpcError as err:
            return err.code()
        return grpc.StatusCode.OK


def test_bearer_scheme_is_case_insensitive_and_bad_credentials_change_nothing(
    server_factory: ServerFactory,
) -> None:
    srv = server_factory(env={"FILA_BOOTSTRAP_APIKEY": BOOT})
    queue = unique("scheme")
    with Client(srv.addr, api_key=BOOT) as admin:
        admin.create_queue(queue)
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        assert _raw_enqueue(srv.addr, queue, (("authorization", f"{scheme} {BOOT}"),)) == (
            grpc.StatusCode.OK
        )
    assert _raw_enqueue(srv.addr, queue, (("authorization", f"Bearer   {BOOT} "),)) == (
        grpc.StatusCode.OK
    )
    for bad in (f"Basic {BOOT}", "Bearer", BOOT, "Bearer wrong", f"Bearer {BOOT}x", ""):
        metadata = (("authorization", bad),)
        assert _raw_enqueue(srv.addr, queue, metadata) == grpc.StatusCode.UNAUTHENTICATED, bad
    assert _raw_enqueue(srv.addr, queue, ()) == grpc.StatusCode.UNAUTHENTICATED
    with Client(srv.addr, api_key="wrong") as client, pytest.raises(UnauthenticatedError):
        client.create_queue(unique("never"))
    with Client(srv.addr, api_key=BOOT) as admin:
        assert admin.get_stats(queue).depth == 5
        assert queue_names(admin) == {queue, f"{queue}.dlq"}
    # An undecodable request is INVALID_ARGUMENT, as without auth, whatever the key's ACL.
    with Client(srv.addr, api_key=BOOT) as admin:
        nobody = admin.create_api_key(unique("nobody"))
    with grpc.insecure_channel(srv.addr) as channel:
        garbage = channel.unary_unary(
            "/fila.v1.FilaService/Enqueue",
            request_serializer=lambda raw: raw,
            response_deserializer=service_pb2.EnqueueResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as bad:
            garbage(b"\xff\xff\xff", metadata=(("authorization", f"Bearer {nobody.key}"),))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # Health and reflection stay open.
    with grpc.insecure_channel(srv.addr) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        services = {s.name for s in next(reflect).list_services_response.service}
        assert {"fila.v1.FilaService", "fila.v1.FilaAdmin"} <= services


def test_failed_attempts_are_logged_rate_limited_and_slowed(server_factory: ServerFactory) -> None:
    srv = server_factory(env={"FILA_BOOTSTRAP_APIKEY": BOOT})
    queue = unique("flood")
    with Client(srv.addr, api_key=BOOT) as admin:
        admin.create_queue(queue)
    wrong_keys = [f"fila_{uuid.uuid4().hex}{uuid.uuid4().hex}" for _ in range(120)]

    async def scenario() -> tuple[float, list[grpc.StatusCode], list[float]]:
        async with grpc.aio.insecure_channel(srv.addr) as channel:
            stub = service_pb2_grpc.FilaServiceStub(channel)
            request = service_pb2.EnqueueRequest(queue=queue, payload=b"x")
            todo = list(wrong_keys)
            codes: list[grpc.StatusCode] = []
            legit_ms: list[float] = []

            async def attacker() -> None:
                while todo:
                    key = todo.pop()
                    try:
                        await stub.Enqueue(request, metadata=(("authorization", f"Bearer {key}"),))
                    except grpc.aio.AioRpcError as err:
                        codes.append(err.code())

            async def legitimate() -> None:
                while todo:
                    start = time.perf_counter()
                    await stub.Enqueue(request, metadata=(("authorization", f"Bearer {BOOT}"),))
                    legit_ms.append((time.perf_counter() - start) * 1000)
                    await asyncio.sleep(0.01)

            start = time.perf_counter()
            await asyncio.gather(legitimate(), *(attacker() for _ in range(40)))
            return time.perf_counter() - start, codes, legit_ms

    elapsed, codes, legit_ms = asyncio.run(scenario())
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * len(wrong_keys)
    # Unslowed, 120 refusals take a few tens of ms; the guard holds a failing host's answers.
    assert elapsed > 1.0
    # Calls with a valid key from the same host are not held (a held call waits at least
    # 0.5 s once the host is past its free failures); the median shrugs off CPU contention.
    assert len(legit_ms) > 10 and statistics.median(legit_ms) < 100, legit_ms
    assert srv.running
    lines = [line for line in srv.log_text().splitlines() if "auth failed" in line]
    assert 1 <= len(lines) <= 10 + elapsed + 1  # burst of 10, then 1 a second
    prints = {fingerprint(k) for k in wrong_keys}
    for line in lines:
        assert "peer=ipv4:127.0.0.1:" in line and "reason=unknown" in line
        assert line.split("key_fingerprint=")[1].split()[0] in prints
    unlogged = sum(int(line.rsplit("unlogged_before=", 1)[1]) for line in lines)
    assert len(lines) + unlogged <= len(wrong_keys)
    log = srv.log_text()
    assert not any(k in log for k in wrong_keys)


# --- Clients: the published SDK, fila_sdk's AsyncClient, the CLI ----------------------------

PUBLISHED = "fila-python==0.2.0"

# fila-python 0.2.0 has no key-management methods on its Client; it ships the generated
# FilaAdmin stub, which is how its users reach these RPCs. Both are driven unchanged.
PUBLISHED_SCRIPT = textwrap.dedent(
    """
    import sys
    import grpc
    import fila
    assert fila.__file__.startswith(sys.argv[3]), fila.__file__  # the published package
    from fila import Client
    from fila.errors import RPCError
    from fila.v1 import admin_pb2, admin_pb2_grpc

    addr, boot = sys.argv[1], sys.argv[2]
    auth = (("authorization", "Bearer " + boot),)
    admin = admin_pb2_grpc.FilaAdminStub(grpc.insecure_channel(addr))
    admin.CreateQueue(admin_pb2.CreateQueueRequest(name="pub.orders"), metadata=auth)
    created = admin.CreateApiKey(admin_pb2.CreateApiKeyRequest(name="pub"), metadata=auth)
    assert created.key and created.key_id and not created.is_superadmin, created
    admin.SetAcl(
        admin_pb2.SetAclRequest(
            key_id=created.key_id,
            permissions=[admin_pb2.AclPermission(kind="produce", pattern="pub.*")],
        ),
        metadata=auth,
    )
    acl = admin.GetAcl(admin_pb2.GetAclRequest(key_id=created.key_id), metadata=auth)
    assert [(p.kind, p.pattern) for p in acl.permissions] == [("produce", "pub.*")], acl
    listed = admin.ListApiKeys(admin_pb2.ListApiKeysRequest(), metadata=auth).keys
    assert [(k.key_id, k.name) for k in listed] == [(created.key_id, "pub")], listed
    with Client(addr, api_key=created.key) as client:
        client.enqueue("pub.orders", {"a": "b"}, b"hello")
        try:
            client.enqueue("elsewhere", None, b"x")
        except RPCError as err:
            assert err.code == grpc.StatusCode.PERMISSION_DENIED, err
        else:
            raise AssertionError("enqueue outside the ACL must fail")
    admin.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(key_id=created.key_id), metadata=auth)
    with Client(addr, api_key=created.key) as client:
        try:
            client.enqueue("pub.orders", None, b"x")
        except RPCError as err:
            assert err.code == grpc.StatusCode.UNAUTHENTICATED, err
        else:
            raise AssertionError("a revoked key must be refused")
    print("published-sdk-keys-ok")
    """
)


@pytest.fixture(scope="session")
def published_sdk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("published-sdk-security")
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    subprocess.run(
        [*pip, "--target", str(target), PUBLISHED],
        check=True,
        timeout=120,
    )
    return target


def test_published_sdk_key_management(server_factory: ServerFactory, published_sdk: Path) -> None:
    srv = server_factory(env={"FILA_BOOTSTRAP_APIKEY": BOOT})
    result = subprocess.run(
        [sys.executable, "-P", "-c", PUBLISHED_SCRIPT, srv.addr, BOOT, str(published_sdk)],
        env={"PYTHONPATH": str(published_sdk), "PATH": "/usr/bin:/bin"},
        cwd=published_sdk,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "published-sdk-keys-ok" in result.stdout


def test_async_client_key_calls(secured: ServerProcess) -> None:
    async def scenario() -> None:
        async with AsyncClient(secured.addr, api_key=BOOT) as admin:
            created = await admin.create_api_key(unique("async"))
            await admin.set_acl(created.key_id, [AclPermission("consume", "a.*"), "produce:b"])
            acl = await admin.get_acl(created.key_id)
            assert acl.permissions == (
                AclPermission("consume", "a.*"),
                AclPermission("produce", "b"),
            )
            assert created.key_id in {k.key_id for k in await admin.list_api_keys()}
            await admin.revoke_api_key(created.key_id)
            with pytest.raises(ApiKeyNotFoundError):
                await admin.get_acl(created.key_id)

    asyncio.run(scenario())


def _fila(server: ServerProcess, *args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, ["--addr", server.addr, *args], prog_name="fila", env=env)


def _ok(server: ServerProcess, *args: str, env: dict[str, str] | None = None) -> str:
    result = _fila(server, *args, env=env)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    return result.stdout


def test_cli_apikey_and_acl_commands(secured: ServerProcess) -> None:
    boot = {"FILA_API_KEY": BOOT}
    name = unique("cli")
    created = json.loads(
        _ok(secured, "--json", "apikey", "create", name, "--expires-in", "1h30m", env=boot)
    )
    assert created["name"] == name and created["key"].startswith("fila_")
    assert not created["is_superadmin"]
    expires = datetime.fromisoformat(created["expires_at"])
    assert abs((expires - datetime.now(UTC)).total_seconds() - 5400) < 60
    human = _ok(secured, "--api-key", BOOT, "apikey", "create", unique("su"), "--superadmin")
    assert "superadmin" in human and "fila_" in human and "shown only now" in human

    listed = json.loads(_ok(secured, "apikey", "list", "--json", env=boot))  # --json after too
    mine = next(k for k in listed if k["key_id"] == created["key_id"])
    assert mine["name"] == name and mine["expires_at"] and "key" not in mine
    table = _ok(secured, "apikey", "list", env=boot)
    assert created["key_id"] in table and name in table and created["key"] not in table

    key_id = created["key_id"]
    set_out = json.loads(
        _ok(
            secured, "acl", "set", key_id, "produce:orders:eu", "consume:acme.*", "--json", env=boot
        )
    )
    assert set_out["permissions"] == [
        {"kind": "produce", "pattern": "orders:eu"},
        {"kind": "consume", "pattern": "acme.*"},
    ]
    assert json.loads(_ok(secured, "--json", "acl", "get", key_id, env=boot)) == {
        "key_id": key_id,
        "permissions": set_out["permissions"],
        "is_superadmin": False,
    }
    shown = _ok(secured, "acl", "get", key_id, env=boot)
    assert "orders:eu" in shown and "acme.*" in shown

    # The created key works from the CLI through FILA_API_KEY, within its ACL only.
    as_created = {"FILA_API_KEY": created["key"]}
    denied = _fila(secured, "apikey", "list", env=as_created)
    assert denied.exit_code == 1 and denied.stderr.startswith("fila: error: ")
    assert "only superadmin" in denied.stderr and created["key"] not in denied.stderr

    bad = _fila(secured, "acl", "set", key_id, "write:orders", env=boot)
    assert bad.exit_code == 1 and 'unknown ACL kind "write"' in bad.stderr
    assert _fila(secured, "acl", "set", key_id, "no-colon", env=boot).exit_code == 2
    assert _fila(secured, "acl", "set", key_id, env=boot).exit_code == 2
    assert _fila(secured, "apikey", "create", "x", "--expires-in", "soon", env=boot).exit_code == 2

    assert json.loads(_ok(secured, "apikey", "revoke", key_id, "--json", env=boot)) == {
        "key_id": key_id,
        "revoked": True,
    }
    gone = _fila(secured, "apikey", "revoke", key_id, env=boot)
    assert gone.exit_code == 1 and f'API key "{key_id}" not found' in gone.stderr
    refused = _fila(secured, "queue", "list", env=as_created)
    assert refused.exit_code == 1 and "unknown or revoked API key" in refused.stderr


def test_redrive_needs_admin_on_the_queue_it_writes_into(
    admin: Client, secured: ServerProcess
) -> None:
    queue = unique("rd")
    admin.create_queue(queue, on_failure='function on_failure(m) return {action="dlq"} end')
    admin.enqueue(queue, None, b"poison")
    stream = admin.consume(queue)
    admin.nack(queue, next(stream).id, "fatal")
    stream.close()
    dlq_only = new_key(admin, f"admin:{queue}.dlq")
    with as_key(secured, dlq_only) as client, pytest.raises(PermissionDeniedError):
        client.redrive(f"{queue}.dlq")
    both = new_key(admin, f"admin:{queue}")
    with as_key(secured, both) as client:
        assert client.redrive(f"{queue}.dlq") == 1


def test_a_key_lost_before_anyone_listened_reports_it_to_the_first_listener() -> None:
    """A stream that subscribes to its key's loss after the revocation (or the expiry)
    hears of it at once, not never."""

    async def scenario() -> None:
        committer = Committer(MemoryStorage(), "buffer", lambda exc: None)
        clock = ManualClock()
        keyring = Keyring(LocalKeyStore(MemoryStorage(), committer), clock, BOOT)
        revoked_record, revoked_key, written = keyring.create(None, "gone", 0, False)
        await written
        _, expiring_key, written = keyring.create(None, "short", clock.now_ms() + 10, False)
        await written
        revoked, expiring = keyring.authenticate(revoked_key), keyring.authenticate(expiring_key)
        assert not isinstance(revoked, Refusal) and not isinstance(expiring, Refusal)
        await keyring.revoke(None, revoked_record.key_id)
        clock.advance(11)
        for caller in (revoked, expiring):
            lost = caller.key_lost()
            assert lost.done() and "revoked or expired" in str(lost.result())
        committer.close()

    asyncio.run(scenario())


def test_an_acl_change_applies_to_the_next_check_of_a_key_already_checked() -> None:
    """A key's ACL answers are remembered per queue (fila.security.keyring); SetAcl
    forgets them, so the very next check sees the new ACL."""

    async def scenario() -> None:
        committer = Committer(MemoryStorage(), "buffer", lambda exc: None)
        keyring = Keyring(LocalKeyStore(MemoryStorage(), committer), ManualClock(), BOOT)
        record, key, written = keyring.create(None, "tenant", 0, False)
        await written
        await keyring.set_acl(None, record.key_id, [("produce", "a")])
        caller = keyring.authenticate(key)
        assert not isinstance(caller, Refusal)
        assert (caller.permits(Kind.PRODUCE, "a"), caller.permits(Kind.PRODUCE, "b")) == (
            True,
            False,
        )
        await keyring.set_acl(None, record.key_id, [("produce", "b")])
        assert (caller.permits(Kind.PRODUCE, "a"), caller.permits(Kind.PRODUCE, "b")) == (
            False,
            True,
        )
        committer.close()

    asyncio.run(scenario())


def test_the_auth_interceptor_reuses_a_keys_wrapper_and_refuses_it_once_revoked() -> None:
    """The authorized wrapper of a (method, key) is built once (fila.server.auth); a
    revoked key is refused before anything is reused, and another key gets its own."""
    method = "/fila.v1.FilaService/Enqueue"

    async def behaviour(request: Any, context: Any) -> None:
        return None

    handler = grpc.unary_unary_rpc_method_handler(behaviour)
    handlers = [handler]

    async def continuation(details: Any) -> Any:
        return handlers[-1]

    @dataclass
    class Details:
        method: str
        invocation_metadata: tuple[tuple[str, str], ...]

    async def scenario() -> None:
        committer = Committer(MemoryStorage(), "buffer", lambda exc: None)
        keyring = Keyring(LocalKeyStore(MemoryStorage(), committer), ManualClock(), BOOT)
        interceptor = AuthInterceptor(keyring)
        first, first_key, written = keyring.create(None, "first", 0, False)
        await written
        _, second_key, written = keyring.create(None, "second", 0, False)
        await written

        async def wrapper(key: str) -> Any:
            details = Details(method, (("authorization", f"Bearer {key}"),))
            return await interceptor.intercept_service(continuation, details)  # type: ignore[arg-type]

        reused = await wrapper(first_key)
        assert reused is not handler
        assert await wrapper(first_key) is reused
        other = await wrapper(second_key)
        assert other is not reused
        await keyring.revoke(None, first.key_id)
        assert await wrapper(first_key) is not reused  # the refusal, not the wrapper
        assert await wrapper(second_key) is other
        handlers.append(grpc.unary_unary_rpc_method_handler(behaviour))  # another server
        assert await wrapper(second_key) is not other
        committer.close()

    asyncio.run(scenario())


class _FlakyStore:
    """A KeyStore whose writes fail while `failing` is set (a disk error; in cluster
    mode, etcd away)."""

    def __init__(self) -> None:
        self.failing = False

    def load(self) -> StoredKeys:
        return StoredKeys([], {})

    async def _write(self) -> None:
        if self.failing:
            raise Unavailable("the store is away")

    def save_key(self, record: Any) -> Any:
        return self._write()

    def save_acl(self, key_id: str, permissions: Any) -> Any:
        return self._write()

    def delete_key(self, key_id: str) -> Any:
        return self._write()


def test_a_key_change_the_store_did_not_take_changes_nothing() -> None:
    """A revocation, an ACL change or a creation whose write fails leaves the keyring
    as the store has it: the key still authenticates, is listed, keeps its ACL, and a
    retry of the revocation succeeds. (In cluster mode nothing else could set it
    right: etcd's copy did not change, so the mirror has nothing newer to apply.)"""

    async def scenario() -> None:
        store = _FlakyStore()
        keyring = Keyring(store, ManualClock(), BOOT)
        record, key, written = keyring.create(None, "kept", 0, False)
        await written
        await keyring.set_acl(None, record.key_id, [("produce", "*")])
        store.failing = True
        with pytest.raises(Unavailable):
            await keyring.revoke(None, record.key_id)
        with pytest.raises(Unavailable):
            await keyring.set_acl(None, record.key_id, [("consume", "*")])
        _, unwritten_key, unwritten = keyring.create(None, "unwritten", 0, False)
        with pytest.raises(Unavailable):
            await unwritten
        caller = keyring.authenticate(key)
        assert not isinstance(caller, Refusal) and caller.valid()
        assert [r.key_id for r in keyring.list_keys(None)] == [record.key_id]
        assert [str(p) for p in keyring.get_acl(None, record.key_id)[1]] == ["produce:*"]
        assert keyring.authenticate(unwritten_key) is Refusal.UNKNOWN
        store.failing = False
        await keyring.revoke(None, record.key_id)
        assert keyring.authenticate(key) is Refusal.UNKNOWN
        assert caller.key_lost().done() and not caller.valid()
        assert keyring.list_keys(None) == []

    asyncio.run(scenario())


# --- Calls opened before a revocation ----------------------------------------------------


class _HeldCall:
    """A call whose headers (with the key) go out now and whose request goes out later:
    a unary method opened as a stream, as any HTTP/2 client can."""

    def __init__(self, channel: grpc.Channel, method: str, response: Any, key: str) -> None:
        self._requests: Queue[Any] = Queue()
        stream = channel.stream_stream(
            method,
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=response.FromString,
        )
        self._responses = stream(
            iter(self._requests.get, None),
            metadata=(("authorization", f"Bearer {key}"),),
            timeout=30,
        )

    def send(self, request: Any) -> Any:
        self._requests.put(request)
        self._requests.put(None)
        return next(iter(self._responses))


def _headers_seen(secured: ServerProcess, key: str) -> None:
    """A later call on the same connection has been answered: the held call's headers,
    sent before it, have been through the broker's authentication."""
    with as_key(secured, key) as client:
        client.list_queues()


def test_a_request_that_arrives_after_its_key_was_revoked_is_refused(
    admin: Client, secured: ServerProcess
) -> None:
    ops = new_key(admin, superadmin=True)
    with grpc.insecure_channel(secured.addr) as channel:
        held = _HeldCall(
            channel, "/fila.v1.FilaAdmin/CreateApiKey", admin_pb2.CreateApiKeyResponse, ops.key
        )
        _headers_seen(secured, ops.key)
        admin.revoke_api_key(ops.key_id)
        with pytest.raises(grpc.RpcError) as refused:
            held.send(admin_pb2.CreateApiKeyRequest(name=unique("backdoor"), is_superadmin=True))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(admin.list_api_keys()) == len({k.key_id for k in admin.list_api_keys()})
    assert not [k for k in admin.list_api_keys() if k.name.startswith("backdoor")]


def test_a_consume_stream_that_starts_after_its_key_was_revoked_is_refused(
    admin: Client, secured: ServerProcess
) -> None:
    name = unique("held")
    admin.create_queue(name)
    consumer = new_key(admin, f"consume:{name}")
    with grpc.insecure_channel(secured.addr) as channel:
        held = _HeldCall(
            channel, "/fila.v1.FilaService/StreamConsume", service_pb2.ConsumeResponse, consumer.key
        )
        _headers_seen(secured, consumer.key)
        admin.revoke_api_key(consumer.key_id)
        admin.enqueue(name, None, b"after the revocation")
        with pytest.raises(grpc.RpcError) as refused:
            held.send(service_pb2.StreamConsumeRequest(queue=name))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert admin.get_stats(name).in_flight == 0


async def _next_delivery(stream: Any) -> service_pb2.ConsumeResponse:
    """The next ConsumeResponse that carries a message (keepalives skipped)."""
    while True:
        response = await asyncio.wait_for(stream.read(), RPC_WAIT_S)
        if response.HasField("message") or response.messages:
            return response  # type: ignore[no-any-return]


RPC_WAIT_S = 10.0


def test_an_acl_change_leaves_open_streams_running_and_stream_enqueue_applies_it_next(
    admin: Client, secured: ServerProcess
) -> None:
    """semantics.md, Security: changing a key's ACL does not end open streams; a consume
    stream keeps its queue (and settles on it), a StreamEnqueue applies the new ACL
    from its next request, message by message."""
    queue, elsewhere = unique("aclkeep"), unique("aclnew")
    admin.create_queue(queue)
    admin.create_queue(elsewhere)
    key = new_key(admin, f"consume:{queue}", f"produce:{queue}")
    md = (("authorization", f"Bearer {key.key}"),)

    def message(name: str, payload: bytes) -> service_pb2.EnqueueRequest:
        return service_pb2.EnqueueRequest(queue=name, payload=payload)

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(secured.addr) as channel:
            svc = service_pb2_grpc.FilaServiceStub(channel)
            consuming = svc.StreamConsume(metadata=md)
            await consuming.write(service_pb2.StreamConsumeRequest(queue=queue))
            producing = svc.StreamEnqueue(metadata=md)
            await producing.write(
                service_pb2.StreamEnqueueRequest(
                    sequence_number=1, messages=[message(queue, b"before")]
                )
            )
            before = await asyncio.wait_for(producing.read(), RPC_WAIT_S)
            assert before.results[0].message_id
            assert (await _next_delivery(consuming)).message.payload == b"before"

            await asyncio.to_thread(admin.set_acl, key.key_id, [f"produce:{elsewhere}"])

            await producing.write(
                service_pb2.StreamEnqueueRequest(
                    sequence_number=2,
                    messages=[message(queue, b"refused"), message(elsewhere, b"allowed")],
                )
            )
            after = await asyncio.wait_for(producing.read(), RPC_WAIT_S)
            assert after.sequence_number == 2
            refused, allowed = after.results
            assert refused.error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
            assert allowed.message_id
            # The consume stream is still open on its queue: it gets the next message
            # and settles what it holds.
            await asyncio.to_thread(admin.enqueue, queue, None, b"still consumed")
            delivered = await _next_delivery(consuming)
            assert delivered.message.payload == b"still consumed"
            await consuming.write(service_pb2.StreamConsumeRequest(ack_ids=[delivered.message.id]))
            await producing.done_writing()
            await consuming.done_writing()

    asyncio.run(scenario())
    assert admin.get_stats(elsewhere).depth == 1

    # "before" came back when the stream ended (it was never acked); the ack on the
    # stream after the change was applied, so "still consumed" is gone.
    def settled() -> bool:
        stats = admin.get_stats(queue)
        return (stats.depth, stats.in_flight) == (1, 0)

    wait_until(settled, RPC_WAIT_S)


def test_the_bootstrap_key_is_neither_listed_nor_revocable(server_factory: ServerFactory) -> None:
    """semantics.md, Keys: the bootstrap key is configuration, not a stored key."""
    srv = server_factory(env={"FILA_BOOTSTRAP_APIKEY": BOOT})
    with Client(srv.addr, api_key=BOOT) as admin:
        assert admin.list_api_keys() == []
        created = new_key(admin)
        assert [k.key_id for k in admin.list_api_keys()] == [created.key_id]
        with pytest.raises(ApiKeyNotFoundError):
            admin.revoke_api_key(BOOTSTRAP_NAME)
        admin.create_queue(unique("still-works"))
    srv.restart()
    with Client(srv.addr, api_key=BOOT) as admin:
        assert [k.key_id for k in admin.list_api_keys()] == [created.key_id]
