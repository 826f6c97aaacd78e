"""The `fila` command against a real broker: output in both modes, and one-line errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from click.testing import CliRunner, Result

from fila.cli import cli
from fila.server.process import ServerProcess, free_port
from fila_sdk import Client

ON_ENQUEUE = """
function on_enqueue(msg)
  return {
    fairness_key = msg.headers["tenant"] or "default",
    weight = 3,
    throttle_keys = { msg.headers["throttle"] },
  }
end
"""
ON_FAILURE_DLQ = 'function on_failure(msg) return { action = "dlq" } end'


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def fila(server: ServerProcess | str, *args: str) -> Result:
    addr = server if isinstance(server, str) else server.addr
    return CliRunner().invoke(cli, ["--addr", addr, *args], prog_name="fila")


def ok(server: ServerProcess, *args: str) -> str:
    result = fila(server, *args)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert result.stderr == ""
    return result.stdout


def ok_json(server: ServerProcess, *args: str) -> Any:
    return json.loads(ok(server, "--json", *args))


def fails(server: ServerProcess | str, *args: str) -> str:
    """Run a failing command; return its single stderr line."""
    result = fila(server, *args)
    assert result.exit_code == 1, (result.stdout, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit)  # no uncaught exception
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fila: error: "), result.stderr
    return lines[0]


def test_queue_create_list_inspect_delete(server: ServerProcess, tmp_path: Path) -> None:
    name = unique("orders")
    script = tmp_path / "enqueue.lua"
    script.write_text(ON_ENQUEUE)
    out = ok(
        server,
        "queue",
        "create",
        name,
        "--on-enqueue",
        f"@{script}",
        "--visibility-timeout",
        "5000",
    )
    assert f'"{name}"' in out

    throttle = unique("thr")
    with Client(server.addr) as client:
        client.set_config(f"throttle.{throttle}", "2.5,7")
        client.enqueue(name, {"tenant": "acme", "throttle": throttle}, b"1")
        client.enqueue(name, {"tenant": "acme"}, b"2")

    listed = ok(server, "queue", "list")
    assert name in listed and f"{name}.dlq" in listed
    for header in ("name", "depth", "in-flight", "consumers"):
        assert header in listed

    inspected = ok(server, "queue", "inspect", name)
    for text in ("depth", "in-flight", "consumers", "quantum", "acme", "deficit", "weight"):
        assert text in inspected
    for text in (throttle, "rate/s", "2.5", "burst"):
        assert text in inspected

    assert ok(server, "queue", "delete", name).strip() == f'Deleted queue "{name}"'
    assert name not in ok(server, "queue", "list")


def test_queue_commands_json(server: ServerProcess) -> None:
    name = unique("jq")
    created = ok_json(server, "queue", "create", name, "--on-enqueue", ON_ENQUEUE)
    assert created["name"] == name and created["queue_id"]
    with Client(server.addr) as client:
        client.enqueue(name, {"tenant": "t9"}, b"x")

    queues = {q["name"]: q for q in ok_json(server, "queue", "list")}
    assert queues[name] == {"name": name, "depth": 1, "in_flight": 0, "active_consumers": 0}
    assert f"{name}.dlq" in queues

    stats = ok_json(server, "queue", "inspect", name)
    assert stats["name"] == name and stats["depth"] == 1 and stats["active_fairness_keys"] == 1
    assert stats["per_key"] == [
        {
            "key": "t9",
            "pending_count": 1,
            "current_deficit": stats["per_key"][0]["current_deficit"],
            "weight": 3,
        }
    ]
    assert isinstance(stats["per_throttle"], list)

    assert ok_json(server, "queue", "delete", name) == {"name": name, "deleted": True}


def test_config_set_get_list(server: ServerProcess) -> None:
    prefix = unique("cfg")
    assert f"{prefix}.a = 1" in ok(server, "config", "set", f"{prefix}.a", "1")
    ok(server, "config", "set", f"{prefix}.b", "[bold]not markup[/bold]")
    assert ok(server, "config", "get", f"{prefix}.a") == "1\n"
    assert ok(server, "config", "get", f"{prefix}.b") == "[bold]not markup[/bold]\n"
    listed = ok(server, "config", "list", "--prefix", prefix)
    assert f"{prefix}.a" in listed and f"{prefix}.b" in listed and "2 total" in listed

    assert ok_json(server, "config", "get", f"{prefix}.a") == {"key": f"{prefix}.a", "value": "1"}
    assert ok_json(server, "config", "list", "--prefix", prefix) == {
        "entries": [
            {"key": f"{prefix}.a", "value": "1"},
            {"key": f"{prefix}.b", "value": "[bold]not markup[/bold]"},
        ],
        "total_count": 2,
    }
    fails(server, "config", "get", unique("absent"))


def test_redrive(server: ServerProcess) -> None:
    name = unique("rd")
    ok(server, "queue", "create", name, "--on-failure", ON_FAILURE_DLQ)
    with Client(server.addr) as client:
        client.enqueue(name, None, b"x")
        stream = client.consume(name)
        client.nack(name, next(stream).id, "fatal")
        stream.close()
    assert "Redrove 1 message" in ok(server, "redrive", f"{name}.dlq")
    assert ok_json(server, "redrive", f"{name}.dlq", "--count", "5") == {
        "dlq": f"{name}.dlq",
        "redriven": 0,
    }


def test_errors_are_one_line_and_exit_1(server: ServerProcess, tmp_path: Path) -> None:
    missing = unique("orders")
    assert fails(server, "queue", "delete", missing) == (
        f'fila: error: queue "{missing}" not found'
    )
    assert "not found" in fails(server, "queue", "inspect", missing)

    name = unique("dup")
    ok(server, "queue", "create", name)
    assert "already exists" in fails(server, "queue", "create", name)
    fails(server, "queue", "create", "bad name")
    fails(server, "queue", "create", unique("lua"), "--on-enqueue", "not lua at all (")

    absent = tmp_path / "absent.lua"
    line = fails(server, "queue", "create", unique("f"), "--on-enqueue", f"@{absent}")
    assert str(absent) in line
    fails(server, "--ca-cert", str(absent), "queue", "list")


def test_unreachable_broker_fails_fast() -> None:
    line = fails(f"127.0.0.1:{free_port()}", "queue", "list")
    assert "cannot reach broker" in line


def test_usage_errors_keep_exit_2(server: ServerProcess) -> None:
    assert fila(server, "queue", "create").exit_code == 2
    assert fila(server, "queue", "create", "q", "--visibility-timeout", "soon").exit_code == 2


def test_subprocess_error_has_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fila.cli", "--addr", f"127.0.0.1:{free_port()}", "queue", "list"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("fila: error: ")


def test_subprocess_json_against_server(server: ServerProcess) -> None:
    name = unique("sp")
    run = [sys.executable, "-m", "fila.cli", "--addr", server.addr, "--json"]
    created = subprocess.run(
        [*run, "queue", "create", name], capture_output=True, text=True, timeout=30, check=True
    )
    assert json.loads(created.stdout)["name"] == name
    listed = subprocess.run(
        [*run, "queue", "list"], capture_output=True, text=True, timeout=30, check=True
    )
    assert name in {q["name"] for q in json.loads(listed.stdout)}


def test_addr_from_environment(server: ServerProcess) -> None:
    result = CliRunner().invoke(cli, ["--json", "queue", "list"], env={"FILA_ADDR": server.addr})
    assert result.exit_code == 0, result.stderr
    assert isinstance(json.loads(result.stdout), list)


def _make_certs(root: Path) -> dict[str, Path]:
    """A throwaway CA, a server cert for 127.0.0.1 and a client cert, via openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=fila-test-ca",
    )
    (root / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ext in (("server", ["-extfile", "san.ext"]), ("client", [])):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            *ext,
        )
    return {
        name: root / name
        for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    }


def test_mtls_and_api_key(tmp_path: Path) -> None:
    certs = _make_certs(tmp_path)
    key = "boot-" + uuid.uuid4().hex
    config = (
        f'[tls]\ncert_file = "{certs["server.pem"]}"\nkey_file = "{certs["server.key"]}"\n'
        f'ca_file = "{certs["ca.pem"]}"\n[auth]\nbootstrap_apikey = "{key}"\n'
    )
    creds = grpc.ssl_channel_credentials(
        certs["ca.pem"].read_bytes(),
        certs["client.key"].read_bytes(),
        certs["client.pem"].read_bytes(),
    )
    tls = [
        "--ca-cert",
        str(certs["ca.pem"]),
        "--client-cert",
        str(certs["client.pem"]),
        "--client-key",
        str(certs["client.key"]),
    ]
    with ServerProcess(tmp_path / "data", config_toml=config, channel_credentials=creds) as srv:
        name = unique("secure")
        assert ok_json(srv, *tls, "--api-key", key, "queue", "create", name)["name"] == name
        result = CliRunner().invoke(
            cli,
            ["--addr", srv.addr, *tls, "--json", "queue", "list"],
            env={"FILA_API_KEY": key},
        )
        assert result.exit_code == 0, result.stderr
        assert name in {q["name"] for q in json.loads(result.stdout)}

        assert "fila: error:" in fails(srv, *tls, "queue", "list")  # no API key
        # No client certificate: the broker refuses the handshake. Depending on the TLS
        # version that surfaces while connecting or on the first call; one line either way.
        fails(srv, "--tls", "--ca-cert", str(certs["ca.pem"]), "--api-key", key, "queue", "list")
        assert "together" in fails(srv, "--client-cert", str(certs["client.pem"]), "queue", "list")
