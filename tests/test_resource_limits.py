"""No peer can exhaust the broker: ports, descriptors, connections, memory, answers.

Each test plays the hostile or careless peer against a real broker and checks that
the broker keeps serving a legitimate client, stays within bounds, and answers with
the right status.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerFactory, wait_until
from support.stubs import RPC_TIMEOUT_S, Fila, connect, rpc_error

from fila.testing.server import ServerStartError
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

PROMPT_S = 10.0
MiB = 1024 * 1024


def _rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status", encoding="ascii"):  # noqa: SIM115
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _healthy(addr: str, timeout: float = 2.0) -> bool:
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_second_broker_cannot_share_the_port(server_factory: ServerFactory) -> None:
    first = server_factory()
    second = server_factory(start=False)
    second.port = first.port
    second._env["FILA_LISTEN_ADDR"] = first.addr  # same address, another data directory
    # The health check would reach the first broker, so watch the second process.
    with contextlib.suppress(ServerStartError):
        second.start(timeout=PROMPT_S)
    wait_until(lambda: not second.running, PROMPT_S, what="second broker exited")
    assert second.stop() == 1
    assert f"cannot listen on {first.addr}" in second.log_text()
    assert "Traceback" not in second.log_text()
    assert _healthy(first.addr)


def test_the_open_files_limit_is_raised_to_the_hard_limit(server_factory: ServerFactory) -> None:
    server = server_factory(wrapper=["prlimit", "--nofile=256:8192", "--"])
    limits = open(f"/proc/{server.pid}/limits", encoding="ascii").read()  # noqa: SIM115
    (line,) = [line for line in limits.splitlines() if line.startswith("Max open files")]
    assert line.split()[3:5] == ["8192", "8192"], line


@contextmanager
def _idle_sockets(addr: str, count: int) -> Iterator[list[socket.socket]]:
    host, port = addr.rsplit(":", 1)
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            try:
                sockets.append(socket.create_connection((host, int(port)), timeout=2))
            except OSError:
                break
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def test_idle_connections_cannot_stop_the_broker_or_lock_out_clients(
    server_factory: ServerFactory,
) -> None:
    """At a 256-descriptor limit, 306 connections that never send a byte used to stop
    the broker (RocksDB's next WAL failed with "Too many open files")."""
    server = server_factory(
        wrapper=["prlimit", "--nofile=256:256", "--"],
        config_toml="[server]\nhandshake_timeout_ms = 1000\n",
    )
    assert "server.max_connections=1024 lowered to 128" in server.log_text()
    with _idle_sockets(server.addr, 306) as idle:
        assert len(idle) >= 200
        # The handshake timeout frees the slots; a real client gets through. Like any
        # client it retries UNAVAILABLE while the cap is full (idle sockets still in the
        # listen backlog take freed slots first), on one channel that reconnects
        # promptly: gRPC's default backoff grows past the test's deadline, and channels
        # with default options share one subchannel and its backoff (seen in CI).
        with grpc.insecure_channel(server.addr, options=_PROMPT_RECONNECT) as channel:
            fila = Fila(
                channel,
                service_pb2_grpc.FilaServiceStub(channel),
                admin_pb2_grpc.FilaAdminStub(channel),
            )
            wait_until(
                lambda: _unavailable_or(lambda: fila.create_queue("still-works")),
                PROMPT_S,
                what="CreateQueue answered",
            )
            for _ in range(50):
                fila.enqueue("still-works", b"x")
            assert fila.stats("still-works").depth == 50
    wait_until(lambda: _healthy(server.addr), PROMPT_S, what="health check answered")
    assert server.running


_PROMPT_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]


def _unavailable_or(call: Callable[[], object]) -> bool:
    """True once `call` succeeds; False while the broker turns the connection away."""
    try:
        call()
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return False
    return True


def test_unauthenticated_giant_requests_do_not_make_the_broker_hold_them(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(config_toml='[auth]\nbootstrap_apikey = "secret"\n')
    before = _rss_bytes(server.pid)
    payload = bytes(60 * MiB)
    codes: list[grpc.StatusCode] = []

    def send() -> None:
        with grpc.insecure_channel(
            server.addr, options=[("grpc.max_send_message_length", -1)]
        ) as channel:
            stub = service_pb2.EnqueueRequest
            try:
                channel.unary_unary(
                    "/fila.v1.FilaService/Enqueue",
                    request_serializer=lambda r: r.SerializeToString(),
                    response_deserializer=service_pb2.EnqueueResponse.FromString,
                )(stub(queue="q", payload=payload), timeout=30)
            except grpc.RpcError as exc:
                codes.append(exc.code())

    threads = [threading.Thread(target=send) for _ in range(8)]
    peak = before
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        peak = max(peak, _rss_bytes(server.pid))
        time.sleep(0.01)  # sampling RSS while the requests are in flight
    assert len(codes) == 8
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED}
    grew = (peak - before) / MiB
    print(f"RSS before {before / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB, +{grew:.0f} MiB")
    assert grew < 100, f"8 unauthenticated 60 MiB requests grew the broker by {grew:.0f} MiB"


def test_consumers_that_never_read_pin_a_bounded_amount_of_memory(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="buffer")
    with connect(server.addr) as fila:
        fila.create_queue("big")
        for _ in range(200):
            fila.enqueue("big", os.urandom(MiB))
        before = _rss_bytes(server.pid)
        # Twenty consumers on connections of their own, as separate processes would be
        # (no shared HTTP/2 window between stalled streams), each with a prefetch that
        # leaves every one a share of the 200 messages whatever order they attach in:
        # with the default 16, the first dozen could lease them all (seen in CI).
        with contextlib.ExitStack() as consumers:
            streams = []
            for _ in range(20):
                own = consumers.enter_context(connect(server.addr))
                stream = own.consume("big", read_limit=1, prefetch=10)
                consumers.callback(stream.cancel)
                streams.append(stream)
            for stream in streams:
                stream.get(PROMPT_S)
            wait_until(lambda: fila.stats("big").in_flight >= 40, PROMPT_S)
            settled = _rss_bytes(server.pid)
    grew = (settled - before) / MiB
    print(f"20 stalled 1 MiB streams: RSS +{grew:.0f} MiB")
    # 64 MiB of buffers broker-wide, plus gRPC's per-stream transport buffers
    assert grew < 200, f"20 stalled streams pinned {grew:.0f} MiB"


def test_answers_fit_a_default_client_and_echo_little(server_factory: ServerFactory) -> None:
    server = server_factory(persist_mode="buffer")
    keys = "function on_enqueue(m) return { fairness_key = m.headers.k } end"
    with connect(server.addr) as fila:  # a default client: 4 MiB receive limit
        fila.create_queue("many", on_enqueue=keys)
        batch = [
            service_pb2.EnqueueRequest(queue="many", headers={"k": f"tenant-{i:06d}" * 8})
            for i in range(20_000)
        ]
        for start in range(0, len(batch), 5000):
            fila.svc.EnqueueBatch(
                service_pb2.EnqueueBatchRequest(messages=batch[start : start + 5000]),
                timeout=RPC_TIMEOUT_S,
            )
        stats = fila.stats("many")
        assert stats.active_fairness_keys == 20_000
        assert 0 < len(stats.per_key_stats) <= 1000
        for i in range(100):
            fila.admin.SetConfig(
                admin_pb2.SetConfigRequest(key=f"big.{i}", value="v" * 60_000),
                timeout=RPC_TIMEOUT_S,
            )
        listing = fila.admin.ListConfig(admin_pb2.ListConfigRequest(), timeout=RPC_TIMEOUT_S)
        assert listing.total_count == 100
        assert 0 < len(listing.entries) < 100
        huge_id = "x" * 100_000
        err = rpc_error(fila.svc.Ack, service_pb2.AckRequest(queue="many", message_id=huge_id))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert _longest_echo(err, "x") == ECHO_LIMIT
        err = rpc_error(fila.admin.GetConfig, admin_pb2.GetConfigRequest(key="k" * 100_000))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert _longest_echo(err, "k") == ECHO_LIMIT
        err = rpc_error(
            fila.admin.SetConfig,
            admin_pb2.SetConfigRequest(key="throttle.t", value="1," + "9" * 100_000),
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert _longest_echo(err, "9") <= ECHO_LIMIT


# semantics.md, Limits and load: "Errors echo at most 120 characters of a name or id."
ECHO_LIMIT = 120


def _longest_echo(err: grpc.RpcError, char: str) -> int:
    """The longest run of `char` in the error's message: how much of a name made of
    that one character it echoed."""
    runs = re.findall(f"{re.escape(char)}+", err.details() or "")  # type: ignore[attr-defined]
    return max(map(len, runs), default=0)


def test_queue_count_and_throttle_ranges_are_bounded(server_factory: ServerFactory) -> None:
    server = server_factory(config_toml="[server]\nmax_queues = 3\n")
    with connect(server.addr) as fila:
        for name in ("a", "b", "c"):
            fila.create_queue(name)
        err = rpc_error(fila.admin.CreateQueue, admin_pb2.CreateQueueRequest(name="d"))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_queues" in (err.details() or "")
        fila.delete_queue("a")
        fila.create_queue("d")
        for value in ("1e-300,1", "0.0001,1", "1e12,1", "5,1e12", "5,0.5"):
            err = rpc_error(
                fila.admin.SetConfig, admin_pb2.SetConfigRequest(key="throttle.t", value=value)
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, value
        fila.admin.SetConfig(
            admin_pb2.SetConfigRequest(key="throttle.t", value="0.001,1"), timeout=RPC_TIMEOUT_S
        )


def test_undecodable_requests_get_invalid_argument_and_one_log_line(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    with grpc.insecure_channel(server.addr) as channel:
        raw = channel.unary_unary(
            "/fila.v1.FilaService/Enqueue",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        raw_admin = channel.unary_unary(
            "/fila.v1.FilaAdmin/CreateQueue",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        bad_utf8 = b"\x0a\x02\xff\xfe"  # queue = invalid UTF-8
        garbage = b"\xff\xff\xff\xff\xff"
        for _ in range(200):
            for call, payload in ((raw, bad_utf8), (raw, garbage), (raw_admin, bad_utf8)):
                err = rpc_error(call, payload)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid fila.v1." in (err.details() or "")
    log = server.log_text()
    assert "Traceback" not in log
    refused = [line for line in log.splitlines() if "refused undecodable request" in line]
    assert 1 <= len(refused) <= 3, refused
