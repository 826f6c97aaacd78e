"""`fila-server` startup: bad config stops it with a clear line; the harness lifecycle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerFactory

from fila.server.process import ServerProcess

STARTUP_LIMIT_S = 15.0


def _run_server(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FILA_")}
    clean["FILA_DATA_DIR"] = str(tmp_path / "data")
    clean.update(env or {})
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "fila.server.main", *args],
        cwd=Path(__file__).resolve().parent.parent,
        env=clean,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=STARTUP_LIMIT_S * 2,
    )
    return done, time.monotonic() - began


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nfoo = 1\n", '"server.foo"'),
        ('[scheduler]\nquantum = "many"\n', '"scheduler.quantum"'),
        ("[scheduler]\nquantum = true\n", '"scheduler.quantum"'),
        ('[storage]\npersist_mode = "fast"\n', '"storage.persist_mode"'),
        ("[bogus]\nx = 1\n", '"bogus"'),
    ],
)
def test_bad_config_file_stops_startup(tmp_path: Path, text: str, key: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text, encoding="utf-8")
    done, took = _run_server(tmp_path, "--config", str(bad))
    assert done.returncode != 0, done.stderr
    assert took < STARTUP_LIMIT_S
    assert key in done.stderr
    assert str(bad) in done.stderr


def test_bad_config_from_env_stops_startup(tmp_path: Path) -> None:
    bad = tmp_path / "env.toml"
    bad.write_text("[lua]\ndefault_timeout_ms = 0\n", encoding="utf-8")
    done, _ = _run_server(tmp_path, env={"FILA_CONFIG": str(bad)})
    assert done.returncode != 0
    assert '"lua.default_timeout_ms"' in done.stderr
    assert str(bad) in done.stderr


def test_missing_config_file_stops_startup(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    done, _ = _run_server(tmp_path, "--config", str(missing))
    assert done.returncode != 0
    assert str(missing) in done.stderr
    assert "not found" in done.stderr


def _health(addr: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
    return int(reply.status)


def test_harness_start_stop_kill_restart_keep_the_address(server: ServerProcess) -> None:
    assert _health(server.addr) == health_pb2.HealthCheckResponse.SERVING
    addr, first_pid = server.addr, server.pid
    assert server.stop() == 0
    assert not server.running
    server.restart()
    assert (server.addr, server.running) == (addr, True)
    assert server.pid != first_pid
    assert server.kill() != 0
    server.restart()
    assert _health(addr) == health_pb2.HealthCheckResponse.SERVING
    assert "start #3" in server.log_text()


def test_harness_passes_config_and_env(server_factory: ServerFactory) -> None:
    srv = server_factory(
        config_toml="[scheduler]\nquantum = 2\n",
        persist_mode="buffer",
        env={"FILA_BOOTSTRAP_APIKEY": "k"},
    )
    assert srv.config_path is not None
    assert "quantum = 2" in srv.config_path.read_text(encoding="utf-8")
    assert 'persist_mode = "buffer"' in srv.config_path.read_text(encoding="utf-8")
    # health stays open to unauthenticated callers even with auth on (SPEC 3)
    assert _health(srv.addr) == health_pb2.HealthCheckResponse.SERVING


def test_harness_reports_a_server_that_dies_at_startup(server_factory: ServerFactory) -> None:
    srv = server_factory(config_toml="[server]\nfoo = 1\n", start=False)
    with pytest.raises(RuntimeError, match=r"exited with code .* before serving"):
        srv.start(timeout=STARTUP_LIMIT_S)
    assert '"server.foo"' in srv.log_text()
