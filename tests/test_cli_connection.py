"""`fila` reaching (or not reaching) a broker: each way a connection fails gets its
own one-line reason and fix, at once; `fila health` reports the standard health check.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from support import ServerFactory
from support.cli import clean_env, fails, fila, make_certs, ok, ok_json, run_fila

from fila.cli.connection import CONNECT_TIMEOUT_S
from fila.testing.children import free_port
from fila.testing.server import ServerProcess


def test_refused_says_no_broker_listens_and_fails_at_once() -> None:
    addr = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    line = fails(addr, "queue", "list")
    assert time.monotonic() - started < CONNECT_TIMEOUT_S  # no waiting for a deadline
    assert f"connection refused by {addr}" in line
    assert "fila-server" in line and "--addr / FILA_ADDR" in line


def test_unresolvable_host_is_named() -> None:
    line = fails("no-such-broker.invalid:5555", "queue", "list")
    assert 'cannot resolve host "no-such-broker.invalid"' in line
    assert "--addr / FILA_ADDR" in line


def test_an_address_without_a_port_is_refused_before_connecting() -> None:
    """gRPC would silently try port 443; fila names the default port instead."""
    line = fails("localhost", "queue", "list")
    assert 'address "localhost" has no port' in line and "localhost:5555" in line
    result = fila("localhost", "health")  # the same for every command
    assert "has no port" in result.stderr and result.exit_code == 1
    from_env = run_fila("queue", "list", env=clean_env(FILA_ADDR="broker.example"))
    assert from_env.returncode == 1
    assert 'address "broker.example" has no port: use broker.example:5555' in from_env.stderr
    assert "has no port" in fails("[::1]", "queue", "list")
    assert "[::1]:5555" in fails("::1", "queue", "list")
    assert 'invalid port "http"' in fails("localhost:http", "queue", "list")
    assert 'invalid port "70000"' in fails("localhost:70000", "queue", "list")
    full_width = "\uff15\uff15\uff15\uff15"  # int() reads it as 5555; resolvers do not
    assert f'invalid port "{full_width}"' in fails(f"localhost:{full_width}", "queue", "list")


def test_bracketed_ipv6_and_grpc_uris_are_accepted(server: ServerProcess) -> None:
    port = server.addr.rpartition(":")[2]
    assert ok_json(f"ipv4:127.0.0.1:{port}", "health")["status"] == "SERVING"
    # The broker binds 127.0.0.1 only: a bracketed IPv6 address is accepted as an
    # address, and what fails is the connection to it.
    line = fails(f"[::1]:{port}", "queue", "list")
    assert "has no port" not in line and "invalid port" not in line
    assert f"[::1]:{port}" in line


TlsServer = tuple[ServerProcess, dict[str, Path]]


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[TlsServer]:
    """A broker serving TLS with a certificate from a private CA (no client certs)."""
    certs = make_certs(tmp_path)
    config = f'[tls]\ncert_file = "{certs["server.pem"]}"\nkey_file = "{certs["server.key"]}"\n'
    creds = grpc.ssl_channel_credentials(certs["ca.pem"].read_bytes())
    with ServerProcess(tmp_path / "data", config_toml=config, channel_credentials=creds) as srv:
        yield srv, certs


def test_tls_mismatches_are_explained(tls_server: TlsServer) -> None:
    srv, certs = tls_server
    ca = str(certs["ca.pem"])
    assert ok_json(srv, "--ca-cert", ca, "health")["status"] == "SERVING"

    plaintext = fails(srv, "queue", "list")
    assert "serves TLS but fila connected in plaintext" in plaintext and "--tls" in plaintext

    untrusted = fails(srv, "--tls", "queue", "list")  # the system CAs did not sign it
    assert "the broker's certificate is not trusted" in untrusted and "--ca-cert" in untrusted


def test_tls_mismatch_is_one_line_in_a_real_process(tls_server: TlsServer) -> None:
    srv, _ = tls_server
    proc = run_fila("--addr", srv.addr, "--tls", "queue", "list")
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "not trusted" in proc.stderr, proc.stderr


def test_health(server_factory: ServerFactory) -> None:
    srv = server_factory()
    assert ok(srv, "health") == "SERVING\n"
    for args in (("--json", "health"), ("health", "--json")):
        result = fila(srv, *args)
        assert result.exit_code == 0
        assert json.loads(result.stdout) == {"addr": srv.addr, "service": "", "status": "SERVING"}
    served = ok_json(srv, "health", "--service", "fila.v1.FilaService")
    assert served["status"] == "SERVING"

    assert fails(srv, "health", "--service", "nope") == (
        f'fila: error: the broker at {srv.addr} has no service "nope"'
    )
    srv.stop()
    assert "connection refused" in fails(srv, "health")


def test_health_not_serving_exits_1() -> None:
    """A broker that is shutting down answers NOT_SERVING (here a bare health server)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        addr = f"127.0.0.1:{port}"
        result = fila(addr, "health")
        assert result.exit_code == 1
        assert result.stdout == "NOT_SERVING\n"
        assert result.stderr == f"fila: error: the broker at {addr} is NOT_SERVING\n"
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert ok(addr, "health") == "SERVING\n"
    finally:
        server.stop(None)
