"""HTTP/2 abuse from one unauthenticated peer: rapid reset, and connections that hold a
slot without answering.

Each test drives a real broker with a hand-written HTTP/2 client (`support.h2raw`)
that does what gRPC's own client never would, and checks what the transport settings
in `fila.server.main.server_options` promise: a connection may have only so many
calls open, counting the ones it reset (`fila.server.limits.STREAMS_PER_CONNECTION`),
and a peer that does not acknowledge the broker's SETTINGS or PINGs is disconnected
after `server.keepalive_timeout_ms`, while one that answers keeps its connection.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Callable

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerFactory, wait_until
from support.h2raw import (
    ENHANCE_YOUR_CALM,
    FLAG_END_HEADERS,
    HEADERS,
    PING,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    RawH2Connection,
    frame,
    grpc_request_headers,
    open_and_reset,
)
from support.stubs import RPC_TIMEOUT_S, connect

from fila.server.limits import STREAMS_PER_CONNECTION, streams_per_connection

SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
SETTINGS_TIMEOUT = 0x4  # GOAWAY error code
# Short keepalive timers, so that a disconnection shows within a test's seconds.
FAST_KEEPALIVE = "[server]\nkeepalive_interval_ms = 1000\nkeepalive_timeout_ms = 1000\n"
PROMPT_S = 8.0


def _advertised_settings(conn: RawH2Connection) -> dict[int, int]:
    """The broker's first SETTINGS frame, as {identifier: value}."""
    _pump_until([conn], lambda: conn.count(SETTINGS, flags=0) > 0, PROMPT_S)
    payload = next(f.payload for f in conn.frames if f.kind == SETTINGS and not f.flags)
    return dict(struct.unpack(">HI", payload[i : i + 6]) for i in range(0, len(payload), 6))


def _pump_until(conns: list[RawH2Connection], done: Callable[[], bool], within: float) -> None:
    """Reads on every connection (answering as each is configured) until `done()`."""
    deadline = time.monotonic() + within
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done within {within}s")
        for conn in conns:
            conn.pump(0.02)


def test_rapid_reset_is_refused_per_connection_and_other_clients_are_served(
    server_factory: ServerFactory,
) -> None:
    """Before the limit, one connection opening and resetting health checks as fast as
    it could got 433,000 calls queued in 15 s, and another client's calls failed with
    CANCELLED all along. Now the broker advertises a stream limit, refuses the streams
    past it (reset ones count until their calls are finished), and the other client
    is served meanwhile."""
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("bystander")
    with RawH2Connection(server.host, server.port).start() as attacker:
        settings = _advertised_settings(attacker)
        assert settings[SETTINGS_MAX_CONCURRENT_STREAMS] == STREAMS_PER_CONNECTION
        stop = threading.Event()
        sent = [0]

        def flood() -> None:
            stream_id = 1
            while not stop.is_set() and attacker.send(open_and_reset(stream_id, 200)):
                stream_id += 400
                sent[0] += 200
                attacker.pump(0.0)

        flooder = threading.Thread(target=flood, name="rapid-reset", daemon=True)
        flooder.start()
        try:
            # Well into the flood (several times the limit) before the bystander calls.
            wait_until(lambda: sent[0] >= 20 * STREAMS_PER_CONNECTION, PROMPT_S)
            with connect(server.addr) as fila:
                health = health_pb2_grpc.HealthStub(fila.channel)
                for _ in range(5):
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=RPC_TIMEOUT_S)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    fila.enqueue("bystander", b"x")
                assert fila.stats("bystander").depth == 5
            assert flooder.is_alive(), "the flood ended before the bystander was done"
        finally:
            stop.set()
            flooder.join(PROMPT_S)
        attacker.pump(0.5)
        refused = attacker.rst_codes().get(REFUSED_STREAM, 0)
        assert refused > 0, f"no stream refused out of {sent[0]} opened and reset"
    assert server.running


def test_a_connection_holds_1024_calls_at_once_and_the_next_is_refused(
    server_factory: ServerFactory,
) -> None:
    """semantics.md, Limits and load: a connection may hold 1,024 calls (HTTP/2 streams)
    at once. 1,024 calls left open (headers sent, no request yet) are all kept; the
    1,025th is refused with REFUSED_STREAM (a gRPC client holds it until one ends)."""
    server = server_factory()
    with RawH2Connection(server.host, server.port).start() as conn:
        assert _advertised_settings(conn)[SETTINGS_MAX_CONCURRENT_STREAMS] == 1024
        block = grpc_request_headers("/grpc.health.v1.Health/Check")
        held = [1 + 2 * n for n in range(1024)]
        conn.send(b"".join(frame(HEADERS, FLAG_END_HEADERS, sid, block) for sid in held))
        extra = held[-1] + 2
        conn.send(frame(HEADERS, FLAG_END_HEADERS, extra, block))

        def reset_streams() -> set[int]:
            return {f.stream_id for f in conn.frames if f.kind == RST_STREAM}

        _pump_until([conn], lambda: extra in reset_streams(), PROMPT_S)
        conn.pump(0.2)
        assert reset_streams() == {extra}
        assert conn.rst_codes() == {REFUSED_STREAM: 1}
    assert server.running


def test_a_peer_that_never_acknowledges_settings_is_closed(server_factory: ServerFactory) -> None:
    """A peer that sends the preface and SETTINGS, then nothing, passes the handshake
    timeout; it used to hold its connection slot for the whole idle timeout (5 min)."""
    server = server_factory(config_toml=FAST_KEEPALIVE)
    with RawH2Connection(server.host, server.port, ack_settings=False, ack_pings=False) as silent:
        silent.start()
        _pump_until([silent], lambda: silent.closed_at is not None, PROMPT_S)
        assert silent.goaway is not None
        assert (silent.goaway.error_code, silent.goaway.debug) == (
            SETTINGS_TIMEOUT,
            b"settings_timeout",
        )
        assert silent.closed_at is not None
        assert silent.closed_at - silent.opened_at < 5.0
    assert server.running


def test_a_peer_that_ignores_pings_is_closed_and_one_that_answers_is_kept(
    server_factory: ServerFactory,
) -> None:
    """Neither makes a call. The broker pings both every keepalive interval; the one
    that never answers is disconnected a keepalive timeout after its first PING (it
    used to be kept: gRPC 1.85's server does not act on its keepalive timeout), the
    one that answers is still connected after several PINGs."""
    server = server_factory(config_toml=FAST_KEEPALIVE)
    with (
        RawH2Connection(server.host, server.port, ack_pings=False) as deaf,
        RawH2Connection(server.host, server.port) as answering,
    ):
        deaf.start()
        answering.start()
        conns = [deaf, answering]
        _pump_until(conns, lambda: deaf.closed_at is not None, PROMPT_S)
        assert deaf.count(PING, flags=0) >= 1
        assert deaf.goaway is not None
        assert (deaf.goaway.error_code, deaf.goaway.debug) == (ENHANCE_YOUR_CALM, b"ping_timeout")
        # Each PING the answering peer acknowledged would have closed it otherwise.
        _pump_until(conns, lambda: answering.count(PING, flags=0) >= 3, PROMPT_S)
        assert answering.closed_at is None
        assert answering.goaway is None
    assert server.running


@pytest.mark.parametrize(
    ("max_connections", "cluster", "expected"),
    [
        (1024, False, STREAMS_PER_CONNECTION),
        (100_000, False, STREAMS_PER_CONNECTION),
        (100, True, STREAMS_PER_CONNECTION),
        (100_000, True, 100_000),
    ],
)
def test_a_cluster_node_allows_a_stream_per_client_connection_of_a_peer(
    max_connections: int, cluster: bool, expected: int
) -> None:
    """A node forwards each of its producers' StreamEnqueue over its one connection to
    the owner node, so there the limit is at least `server.max_connections`."""
    assert streams_per_connection(max_connections, cluster) == expected
