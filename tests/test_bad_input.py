"""Bad requests, RPC by RPC: the right status code, a message naming the offending thing,
the `x-fila-error-kind` trailer, and no change of state.

One broker (a real process with small limits) serves every refusal case; before and
after each case the test takes a snapshot of everything observable (ListQueues,
GetStats of every queue, ListConfig) and requires it unchanged. The baseline holds
ready messages, a message leased by an open consumer stream, and a config entry, so
a refusal that touched any of them would show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from support import ServerFactory, ServerProcess, wait_until
from support.stubs import ConsumeStream, Fila, connect, rpc_error, status_of

from fila.v1 import admin_pb2, service_pb2

MAX_PAYLOAD = 1024
MAX_HEADERS = 8
MAX_HEADER_BYTES = 256
LIMITS_TOML = (
    "[server]\n"
    f"max_message_bytes = {MAX_PAYLOAD}\n"
    f"max_headers = {MAX_HEADERS}\n"
    f"max_header_bytes = {MAX_HEADER_BYTES}\n"
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND


@dataclass
class World:
    server: ServerProcess
    f: Fila
    ready_id: str  # a ready message of queue "base"
    leased_id: str  # a message of queue "held", leased by `stream`
    stream: ConsumeStream


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root: Path = tmp_path_factory.mktemp("bad_input")
    proc = ServerProcess(root / "data", config_toml=LIMITS_TOML).start()
    try:
        with connect(proc.addr) as f:
            f.create_queue("base")
            f.create_queue("held", visibility_timeout_ms=3_600_000)
            ready_id = f.enqueue("base", b"ready", {"h": "v"})
            f.enqueue("base", b"ready too")
            leased_id = f.enqueue("held", b"leased")
            f.admin.SetConfig(admin_pb2.SetConfigRequest(key="app.mode", value="strict"))
            stream = f.consume("held")
            assert stream.get().id == leased_id
            wait_until(lambda: f.stats("held").in_flight == 1, 5.0)
            try:
                yield World(proc, f, ready_id, leased_id, stream)
            finally:
                stream.cancel()
    finally:
        proc.stop()


def snapshot(f: Fila) -> tuple[object, ...]:
    """Everything a client can observe about the broker's state."""
    listing = f.list_queues()
    stats = {q.name: f.stats(q.name) for q in listing.queues}
    config = f.admin.ListConfig(admin_pb2.ListConfigRequest(prefix=""))
    return listing, stats, config


# ------------------------------------------------------------------ request makers

Call = Callable[[World], grpc.RpcError]


def create(name: str, on_enqueue: str = "", on_failure: str = "", vt: int = 0) -> Call:
    config = admin_pb2.QueueConfig(
        on_enqueue_script=on_enqueue, on_failure_script=on_failure, visibility_timeout_ms=vt
    )
    request = admin_pb2.CreateQueueRequest(name=name, config=config)
    return lambda w: rpc_error(w.f.admin.CreateQueue, request)


def enqueue(queue: str, payload: bytes = b"p", headers: dict[str, str] | None = None) -> Call:
    request = service_pb2.EnqueueRequest(queue=queue, payload=payload, headers=headers or {})
    return lambda w: rpc_error(w.f.svc.Enqueue, request)


def consume(queue: str) -> Call:
    def call(w: World) -> grpc.RpcError:
        stream = w.f.consume(queue)
        try:
            end = stream.ended(5.0)
        finally:
            stream.cancel()
        assert end.error is not None, "the stream ended without an error status"
        return end.error

    return call


def ack(queue: str, message_id: str | Callable[[World], str]) -> Call:
    def call(w: World) -> grpc.RpcError:
        mid = message_id(w) if callable(message_id) else message_id
        return rpc_error(w.f.svc.Ack, service_pb2.AckRequest(queue=queue, message_id=mid))

    return call


def nack(queue: str, message_id: str | Callable[[World], str]) -> Call:
    def call(w: World) -> grpc.RpcError:
        mid = message_id(w) if callable(message_id) else message_id
        request = service_pb2.NackRequest(queue=queue, message_id=mid, error="e")
        return rpc_error(w.f.svc.Nack, request)

    return call


def delete(queue: str) -> Call:
    request = admin_pb2.DeleteQueueRequest(queue=queue)
    return lambda w: rpc_error(w.f.admin.DeleteQueue, request)


def get_stats(queue: str) -> Call:
    request = admin_pb2.GetStatsRequest(queue=queue)
    return lambda w: rpc_error(w.f.admin.GetStats, request)


def redrive(queue: str) -> Call:
    request = admin_pb2.RedriveRequest(dlq_queue=queue, count=0)
    return lambda w: rpc_error(w.f.admin.Redrive, request)


def set_config(key: str, value: str) -> Call:
    request = admin_pb2.SetConfigRequest(key=key, value=value)
    return lambda w: rpc_error(w.f.admin.SetConfig, request)


def get_config(key: str) -> Call:
    request = admin_pb2.GetConfigRequest(key=key)
    return lambda w: rpc_error(w.f.admin.GetConfig, request)


def leased(w: World) -> str:
    return w.leased_id


def ready(w: World) -> str:
    return w.ready_id


@dataclass(frozen=True)
class Bad:
    id: str
    call: Call
    code: grpc.StatusCode
    kind: str
    names: tuple[str, ...] = ()  # what the error message must mention


LONG = "q" * 256
NEVER_ISSUED = "018f0000-0000-7000-8000-000000000001"  # a well-formed UUIDv7 never issued
SYNTAX_ERROR = "function on_enqueue(m) return {fairness_key = } end"
NO_HOOK = "function something_else(m) return {} end"
TOP_LEVEL_ERROR = 'error("refusing to load")\nfunction on_enqueue(m) return {} end'

CASES = [
    # CreateQueue: names
    Bad("create-empty-name", create(""), INVALID, "invalid_argument", ("queue name",)),
    Bad("create-space", create("a b"), INVALID, "invalid_argument", ('"a b"',)),
    Bad("create-slash", create("x/y"), INVALID, "invalid_argument", ('"x/y"',)),
    Bad("create-non-ascii", create("é"), INVALID, "invalid_argument", ('"é"',)),
    Bad("create-dot", create("."), INVALID, "invalid_argument", ('"."', "reserved")),
    Bad("create-dot-dot", create(".."), INVALID, "invalid_argument", ('".."', "reserved")),
    Bad("create-256-chars", create(LONG), INVALID, "invalid_argument", ("256", "255")),
    Bad("create-dlq-suffix", create("orders.dlq"), INVALID, "invalid_argument", ("orders.dlq",)),
    Bad("create-dlq-of-existing", create("base.dlq"), INVALID, "invalid_argument", ("base.dlq",)),
    Bad(
        "create-duplicate",
        create("base"),
        grpc.StatusCode.ALREADY_EXISTS,
        "queue_already_exists",
        ('"base"',),
    ),
    # CreateQueue: scripts and config
    Bad(
        "create-lua-syntax",
        create("lua1", on_enqueue=SYNTAX_ERROR),
        INVALID,
        "invalid_argument",
        ("lua1", "on_enqueue"),
    ),
    Bad(
        "create-lua-no-hook",
        create("lua2", on_enqueue=NO_HOOK),
        INVALID,
        "invalid_argument",
        ("lua2", "on_enqueue"),
    ),
    Bad(
        "create-lua-top-level-error",
        create("lua3", on_enqueue=TOP_LEVEL_ERROR),
        INVALID,
        "invalid_argument",
        ("lua3", "refusing to load"),
    ),
    Bad(
        "create-on-failure-no-hook",
        create("lua4", on_failure=NO_HOOK),
        INVALID,
        "invalid_argument",
        ("lua4", "on_failure"),
    ),
    Bad(
        "create-on-failure-syntax",
        create("lua5", on_failure="function on_failure("),
        INVALID,
        "invalid_argument",
        ("lua5", "on_failure"),
    ),
    Bad(
        "create-lua-bytecode",
        create("lua6", on_enqueue="\x1bLua\x54\x00"),
        INVALID,
        "invalid_argument",
        ("lua6",),
    ),
    Bad(
        "create-visibility-over-max",
        create("vt", vt=10**15),
        INVALID,
        "invalid_argument",
        ("visibility_timeout_ms",),
    ),
    # Enqueue
    Bad("enqueue-missing-queue", enqueue("nope"), NOT_FOUND, "queue_not_found", ('"nope"',)),
    Bad("enqueue-malformed-queue", enqueue("a b"), INVALID, "invalid_argument", ('"a b"',)),
    Bad("enqueue-empty-queue-name", enqueue(""), INVALID, "invalid_argument", ("queue name",)),
    Bad(
        "enqueue-payload-over-limit",
        enqueue("base", b"x" * (MAX_PAYLOAD + 1)),
        INVALID,
        "invalid_argument",
        (str(MAX_PAYLOAD + 1), str(MAX_PAYLOAD)),
    ),
    Bad(
        "enqueue-payload-far-over-limit",
        enqueue("base", b"x" * 200_000),
        INVALID,
        "invalid_argument",
        (str(MAX_PAYLOAD),),
    ),
    Bad(
        "enqueue-too-many-headers",
        enqueue("base", headers={f"h{i}": "v" for i in range(MAX_HEADERS + 1)}),
        INVALID,
        "invalid_argument",
        (str(MAX_HEADERS + 1), str(MAX_HEADERS)),
    ),
    Bad(
        "enqueue-header-bytes-over-limit",
        enqueue("base", headers={"k": "v" * MAX_HEADER_BYTES}),
        INVALID,
        "invalid_argument",
        (str(MAX_HEADER_BYTES),),
    ),
    # 1 + 128 * 2 = 257 UTF-8 bytes, but only 129 characters.
    Bad(
        "enqueue-header-bytes-over-limit-multibyte",
        enqueue("base", headers={"k": "é" * (MAX_HEADER_BYTES // 2)}),
        INVALID,
        "invalid_argument",
        (str(MAX_HEADER_BYTES),),
    ),
    # Consume: the status arrives on the first read of the stream
    Bad("consume-missing-queue", consume("nope"), NOT_FOUND, "queue_not_found", ('"nope"',)),
    Bad("consume-malformed-queue", consume("x/y"), INVALID, "invalid_argument", ('"x/y"',)),
    # Ack / Nack
    Bad(
        "ack-unknown-id",
        ack("base", NEVER_ISSUED),
        NOT_FOUND,
        "message_not_found",
        (NEVER_ISSUED, '"base"'),
    ),
    Bad(
        "ack-malformed-id",
        ack("base", "not-a-uuid"),
        NOT_FOUND,
        "message_not_found",
        ("not-a-uuid",),
    ),
    Bad("ack-empty-id", ack("base", ""), NOT_FOUND, "message_not_found", ('"base"',)),
    Bad("ack-ready-not-leased", ack("base", ready), NOT_FOUND, "message_not_found", ('"base"',)),
    Bad(
        "ack-leased-in-other-queue",
        ack("base", leased),
        NOT_FOUND,
        "message_not_found",
        ('"base"',),
    ),
    Bad("ack-missing-queue", ack("nope", leased), NOT_FOUND, "queue_not_found", ('"nope"',)),
    Bad("ack-malformed-queue", ack("a b", leased), INVALID, "invalid_argument", ('"a b"',)),
    Bad(
        "nack-unknown-id",
        nack("held", NEVER_ISSUED),
        NOT_FOUND,
        "message_not_found",
        (NEVER_ISSUED, '"held"'),
    ),
    Bad("nack-malformed-id", nack("held", "%%%"), NOT_FOUND, "message_not_found", ("%%%",)),
    Bad("nack-ready-not-leased", nack("base", ready), NOT_FOUND, "message_not_found", ('"base"',)),
    Bad(
        "nack-leased-in-other-queue",
        nack("base", leased),
        NOT_FOUND,
        "message_not_found",
        ('"base"',),
    ),
    Bad("nack-missing-queue", nack("nope", leased), NOT_FOUND, "queue_not_found", ('"nope"',)),
    # DeleteQueue
    Bad("delete-missing", delete("nope"), NOT_FOUND, "queue_not_found", ('"nope"',)),
    Bad("delete-dlq", delete("base.dlq"), INVALID, "invalid_argument", ("base.dlq", '"base"')),
    Bad("delete-missing-dlq", delete("nope.dlq"), NOT_FOUND, "queue_not_found", ("nope.dlq",)),
    Bad("delete-empty-name", delete(""), INVALID, "invalid_argument", ("queue name",)),
    # GetStats
    Bad("stats-missing", get_stats("nope"), NOT_FOUND, "queue_not_found", ('"nope"',)),
    Bad("stats-malformed", get_stats("a b"), INVALID, "invalid_argument", ('"a b"',)),
    # Redrive and runtime config
    Bad("redrive-not-a-dlq", redrive("base"), INVALID, "invalid_argument", ('"base"',)),
    Bad("redrive-missing", redrive("nope.dlq"), NOT_FOUND, "queue_not_found", ("nope.dlq",)),
    Bad(
        "get-config-missing",
        get_config("no.such.key"),
        NOT_FOUND,
        "config_key_not_found",
        ("no.such.key",),
    ),
    Bad(
        "set-config-bad-throttle",
        set_config("throttle.t", "fast"),
        INVALID,
        "invalid_argument",
        ("throttle.t",),
    ),
    Bad("set-config-empty-key", set_config("", "v"), INVALID, "invalid_argument", ("key",)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_request_is_refused_and_changes_nothing(world: World, case: Bad) -> None:
    before = snapshot(world.f)
    err = case.call(world)
    code, details, kind = status_of(err)
    assert code == case.code, (code, details)
    assert kind == case.kind, (kind, details)
    for name in case.names:
        assert name in details, (name, details)
    assert snapshot(world.f) == before
    # The broker is still up and the baseline lease still held.
    assert not world.stream.done and world.stream.error is None


def test_limits_are_inclusive(server_factory: ServerFactory) -> None:
    """Exactly at each limit is accepted: the refusals above are not off by one."""
    srv = server_factory(config_toml=LIMITS_TOML)
    with connect(srv.addr) as f:
        name = "n" * 255
        assert f.create_queue(name).queue_id == name
        assert f.queue_names() == [name, name + ".dlq"]
        f.create_queue("edge")
        accepted = [
            f.enqueue("edge", b"x" * MAX_PAYLOAD),
            f.enqueue("edge", b"", {f"h{i}": "v" for i in range(MAX_HEADERS)}),
            f.enqueue("edge", b"", {"k": "v" * (MAX_HEADER_BYTES - 1)}),
            f.enqueue(name, b"long name"),
        ]
        assert f.stats("edge").depth == 3
        with f.consume("edge") as stream:
            got = stream.take(3)
        assert [m.id for m in got] == accepted[:3]
        assert len(got[0].payload) == MAX_PAYLOAD
        f.delete_queue(name)
        assert f.queue_names() == ["edge", "edge.dlq"]


def test_full_queue_sheds_load_with_resource_exhausted(server_factory: ServerFactory) -> None:
    """`server.max_queue_depth` bounds a queue's ready + delayed messages; past it an
    enqueue is refused with RESOURCE_EXHAUSTED and stores nothing. Leased messages do
    not count, so once consumers take messages there is room again."""
    srv = server_factory(config_toml="[server]\nmax_queue_depth = 3\n")
    with connect(srv.addr) as f:
        f.create_queue("bounded")
        kept = [f.enqueue("bounded", f"m{i}".encode()) for i in range(3)]
        err = rpc_error(
            f.svc.Enqueue, service_pb2.EnqueueRequest(queue="bounded", payload=b"one too many")
        )
        code, details, kind = status_of(err)
        assert (code, kind) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "resource_exhausted")
        assert '"bounded"' in details and "3" in details
        assert f.stats("bounded").depth == 3
        with f.consume("bounded") as stream:
            got = [m.id for m in stream.take(3)]
            assert got == kept
            wait_until(lambda: f.stats("bounded").depth == 0, 5.0, what="all three leased")
            kept.append(f.enqueue("bounded", b"room again"))
            got += [m.id for m in stream.take(1)]
        assert got == kept
