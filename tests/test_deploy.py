"""deploy/fila.service: what it promises in docs/operations.md, checked against the code
(exit codes, shutdown grace, limits) and against systemd where systemd-analyze exists,
plus a broker started the way the unit starts it (working directory, config file, no
FILA_* environment)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fila.config import Config
from fila.server.startup import ExitCode
from fila.testing.children import free_port

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "deploy" / "fila.service"
DEADLINE_S = 30.0


def unit_settings() -> dict[str, list[str]]:
    """Every `Key=value` of the unit, in order (a key may repeat)."""
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|min)?", value)
    assert match, value
    return int(match[1]) * {"ms": 0.001, "s": 1.0, "min": 60.0, None: 1.0}[match[2]]


def test_unit_matches_the_broker() -> None:
    unit = unit_settings()
    single = {key: values[-1] for key, values in unit.items()}
    assert single["ExecStart"] == "fila-server --config /etc/fila/fila.toml"
    assert (single["User"], single["Group"]) == ("fila", "fila")
    assert single["StateDirectory"] == "fila" and single["WorkingDirectory"] == "/var/lib/fila"
    assert single["Restart"] == "on-failure"
    assert single["KillSignal"] == "SIGTERM"
    no_restart = {int(code) for code in single["RestartPreventExitStatus"].split()}
    assert no_restart == {ExitCode.BAD_CONFIG, ExitCode.DATA_DAMAGED}
    defaults = Config().server
    grace_s = defaults.shutdown_grace_ms / 1000
    assert seconds(single["TimeoutStopSec"]) >= grace_s + 10  # grace, then the final commit
    assert int(single["LimitNOFILE"]) >= 4 * defaults.max_connections
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "CapabilityBoundingSet": "",
    }.items():
        assert single[key] == value, key
    assert "/var/lib/fila" in single["ReadWritePaths"].split()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_unit_passes_systemd_analyze_verify() -> None:
    run = subprocess.run(
        [str(REPO / "scripts" / "verify-unit.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "deploy/fila.service OK" in run.stdout


def test_broker_runs_as_the_unit_starts_it(tmp_path: Path) -> None:
    """The default config, checked and then served from the state directory: data
    lands in <StateDirectory>/data, and SIGTERM stops it well within TimeoutStopSec."""
    state, etc = tmp_path / "var-lib-fila", tmp_path / "etc-fila"
    state.mkdir()
    etc.mkdir()
    server = [sys.executable, "-m", "fila.server.main"]
    default = subprocess.run(
        [*server, "--print-default-config"], capture_output=True, text=True, check=True
    ).stdout
    addr = f"127.0.0.1:{free_port()}"
    config = etc / "fila.toml"
    config.write_text(default.replace('listen_addr = "127.0.0.1:5555"', f'listen_addr = "{addr}"'))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FILA_")}
    checked = subprocess.run(
        [*server, "--check-config", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert checked.returncode == 0 and "configuration OK" in checked.stdout, checked.stderr

    proc = subprocess.Popen(
        [*server, "--config", str(config)],
        cwd=state,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        with grpc.insecure_channel(addr) as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            reply = check(health_pb2.HealthCheckRequest(), timeout=DEADLINE_S, wait_for_ready=True)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert (state / "data").is_dir()
        stop_limit = seconds(unit_settings()["TimeoutStopSec"][-1])
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(stop_limit) == ExitCode.OK
        assert time.monotonic() - started < stop_limit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
