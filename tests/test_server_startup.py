"""`fila-server` startup: bad config stops it with a clear line; the harness lifecycle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import ServerFactory

from fila.testing.server import ServerProcess

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


# -- every startup failure: one line, the documented exit code, no traceback -------------

STARTUP_FAILED, BAD_CONFIG, STORAGE_FAILED = 1, 2, 3


def _one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("fila-server:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def _openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _tls_config(tmp_path: Path, cert: Path, key: Path, ca: Path | None = None) -> Path:
    lines = ["[tls]", f'cert_file = "{cert}"', f'key_file = "{key}"']
    if ca is not None:
        lines.append(f'ca_file = "{ca}"')
    path = tmp_path / f"tls-{cert.stem}-{key.stem}-{ca.stem if ca else ''}.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.skipif(not shutil.which("openssl"), reason="openssl not installed")
def test_bad_tls_files_are_named_with_the_reason(tmp_path: Path) -> None:
    for name in ("a", "b"):
        _openssl(
            tmp_path, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=127.0.0.1", "-keyout", f"{name}.key", "-out", f"{name}.crt",
        )  # fmt: skip
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n", encoding="utf-8")
    cases = [
        (_tls_config(tmp_path, tmp_path / "a.crt", tmp_path / "b.key"), "a.crt"),
        (_tls_config(tmp_path, garbage, tmp_path / "a.key"), "garbage.crt"),
        (_tls_config(tmp_path, tmp_path / "missing.crt", tmp_path / "a.key"), "missing.crt"),
        (_tls_config(tmp_path, tmp_path / "a.crt", tmp_path / "a.key", garbage), "garbage.crt"),
    ]
    for config, named in cases:
        line = _one_line(_run_server(tmp_path, "--config", str(config))[0], STARTUP_FAILED)
        assert named in line
        assert "bind" not in line


def test_limits_beyond_what_grpc_can_carry_are_config_errors(tmp_path: Path) -> None:
    config = tmp_path / "huge.toml"
    config.write_text("[server]\nmax_message_bytes = 1073741824\n", encoding="utf-8")
    line = _one_line(_run_server(tmp_path, "--config", str(config))[0], BAD_CONFIG)
    assert '"server.max_message_bytes"' in line
    config.write_text(
        "[server]\nmax_message_bytes = 20000000\nmax_request_bytes = 16777216\n", encoding="utf-8"
    )
    line = _one_line(_run_server(tmp_path, "--config", str(config))[0], BAD_CONFIG)
    assert '"server.max_request_bytes"' in line


def test_values_grpc_would_refuse_at_startup_fail_check_config_with_exit_2(
    tmp_path: Path,
) -> None:
    """Each used to pass --check-config, then stop the broker at startup: an
    OverflowError traceback from gRPC's channel arguments, or "cannot listen" (exit 1)."""
    config = tmp_path / "grpc.toml"
    for text, key in [
        (
            "[server]\nidle_connection_timeout_ms = 3000000000\n",
            '"server.idle_connection_timeout_ms"',
        ),
        ("[server]\nhandshake_timeout_ms = 2147483648\n", '"server.handshake_timeout_ms"'),
        ('[server]\nlisten_addr = "nonsense"\n', '"server.listen_addr"'),
    ]:
        config.write_text(text, encoding="utf-8")
        for args in (["--check-config"], []):
            done, _ = _run_server(tmp_path, *args, "--config", str(config))
            assert key in _one_line(done, BAD_CONFIG)
    for args in (["--check-config"], []):
        done, _ = _run_server(tmp_path, *args, env={"FILA_LISTEN_ADDR": "nonsense"})
        assert '"FILA_LISTEN_ADDR"' in _one_line(done, BAD_CONFIG)
    assert not (tmp_path / "data").exists()  # refused before anything was opened


def test_a_bad_log_level_is_a_config_error(tmp_path: Path) -> None:
    done, _ = _run_server(tmp_path, env={"FILA_LOG_LEVEL": "verbose"})
    assert "FILA_LOG_LEVEL" in _one_line(done, BAD_CONFIG)


def test_check_config_validates_and_exits(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[scheduler]\nquantum = 3\n", encoding="utf-8")
    done, _ = _run_server(tmp_path, "--check-config", "--config", str(good))
    assert done.returncode == 0
    assert "configuration OK" in done.stdout
    assert not (tmp_path / "data").exists()  # nothing opened or created
    bad = tmp_path / "bad.toml"
    bad.write_text("[scheduler]\nquantum = 0\n", encoding="utf-8")
    done, _ = _run_server(tmp_path, "--check-config", "--config", str(bad))
    assert '"scheduler.quantum"' in _one_line(done, BAD_CONFIG)


def test_a_data_directory_in_use_says_so(server_factory: ServerFactory, tmp_path: Path) -> None:
    running = server_factory()
    done, _ = _run_server(
        tmp_path, env={"FILA_DATA_DIR": str(running.data_dir), "FILA_LISTEN_ADDR": "127.0.0.1:0"}
    )
    line = _one_line(done, STARTUP_FAILED)
    assert "in use by another fila-server" in line
    assert str(running.data_dir) in line


def test_a_data_directory_that_cannot_be_created_is_one_line_exit_1(tmp_path: Path) -> None:
    """A data_dir under a file (as under /dev/null, or on a read-only filesystem): the
    mkdir fails, and the operator gets the directory and the reason, not a traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    data_dir = blocker / "data"
    done, _ = _run_server(
        tmp_path, env={"FILA_DATA_DIR": str(data_dir), "FILA_LISTEN_ADDR": "127.0.0.1:0"}
    )
    line = _one_line(done, STARTUP_FAILED)
    assert str(data_dir) in line and "Not a directory" in line
    assert "FILA_DATA_DIR" in line


def test_a_direct_io_probe_that_cannot_be_removed_does_not_stop_the_broker(
    server_factory: ServerFactory,
) -> None:
    """The probe's cleanup used to raise from its `finally` (on a read-only filesystem
    even the unlink of a file never created fails): a traceback instead of an answer.
    A directory where the probe file goes makes both the probe and its unlink fail."""
    server = server_factory(start=False)
    (server.data_dir / ".direct-io-probe" / "in-the-way").mkdir(parents=True)
    server.start()
    assert server.stop() == 0
    log = server.log_text()
    assert "Traceback" not in log
    listening = next(line for line in log.splitlines() if "msg=listening" in line)
    assert "direct_io=false" in listening


def test_a_storage_failure_while_serving_exits_3_without_a_traceback(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    """A full disk: the data directory is a 40 MiB tmpfs (needs root and mount)."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        server = server_factory(start=False, persist_mode="sync")
        server.data_dir = mount / "data"
        server._env["FILA_DATA_DIR"] = str(server.data_dir)
        server.start()
        with grpc.insecure_channel(server.addr) as channel:
            from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

            admin_pb2_grpc.FilaAdminStub(channel).CreateQueue(
                admin_pb2.CreateQueueRequest(name="q"), timeout=10
            )
            enqueue = service_pb2_grpc.FilaServiceStub(channel).Enqueue
            codes = set()
            # Incompressible: zeros would compress to nothing once flushed to an SST,
            # and the WAL is recycled after each flush, so the disk would never fill.
            payload = os.urandom(1 << 20)
            for _ in range(100):
                try:
                    enqueue(service_pb2.EnqueueRequest(queue="q", payload=payload), timeout=10)
                except grpc.RpcError as exc:
                    codes.add(exc.code())
                    break
        assert codes <= {grpc.StatusCode.UNAVAILABLE}
        deadline = time.monotonic() + 20
        while server.running and time.monotonic() < deadline:
            time.sleep(0.05)  # bounded wait for the broker to stop by itself
        assert server.stop() == STORAGE_FAILED
        log = server.log_text()
        assert "Traceback" not in log
        assert "stopped because storage failed" in log
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


# -- gRPC's process-wide settings ---------------------------------------------------------


def test_the_broker_sets_grpc_experiments_before_grpc_is_first_imported(tmp_path: Path) -> None:
    """gRPC reads GRPC_EXPERIMENTS once, at import: set later, it is silently ignored."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    done = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            "import os, fila.server.main; print(os.environ['GRPC_EXPERIMENTS'])",
        ],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=STARTUP_LIMIT_S * 2,
        check=True,
    )
    assert done.stdout.strip() == "-event_engine_listener"
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    assert "fila.server.grpc_runtime" in imported and "grpc" in imported, done.stderr
    assert imported.index("fila.server.grpc_runtime") < imported.index("grpc")


def test_an_operators_grpc_experiments_are_kept_and_reported(
    server_factory: ServerFactory,
) -> None:
    srv = server_factory(env={"GRPC_EXPERIMENTS": "-event_engine_client"})
    listening = [line for line in srv.log_text().splitlines() if "listening" in line]
    assert listening, srv.log_text()
    assert "grpc_experiments=-event_engine_client " in listening[0]
