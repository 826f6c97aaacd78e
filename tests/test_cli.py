"""The `fila` command against a real broker: output in both modes, and one-line errors."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import click
import grpc
from click.testing import CliRunner
from support import unique
from support.cli import (
    clean_env,
    fails,
    fila,
    make_certs,
    ok,
    ok_json,
    one_error_line,
    run_fila,
)

from fila import __version__
from fila.cli import cli
from fila.cli.context import Command
from fila.testing.children import free_port
from fila.testing.server import ServerProcess
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

    assert ok(server, "queue", "delete", name, "--yes").strip() == f'Deleted queue "{name}"'
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
            "current_deficit": 0,  # granted when the key's turn comes; no consumer yet
            "weight": 3,
            "delivered_total": 0,
        }
    ]
    assert stats["enqueued_total"] == 1 and stats["delivered_total"] == 0
    assert isinstance(stats["per_throttle"], list)

    assert ok_json(server, "queue", "delete", name, "-y") == {"name": name, "deleted": True}


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
    assert fails(server, "queue", "delete", missing, "--yes") == (
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


def test_values_past_what_the_wire_carries_are_one_line_too(server: ServerProcess) -> None:
    """Numbers past uint64 or a date, text that is not UTF-8 (a stray byte in argv) and
    an impossible host name end in one error line, not a traceback."""
    name = unique("edge")
    ok(server, "queue", "create", name)
    assert "out of range" in fails(server, "redrive", f"{name}.dlq", "--count", str(2**64))
    assert "out of range" in fails(server, "enqueue", name, "--delay", f"{2**64}ms", "x")
    # a count past the wire is fine: peek asks for pages of at most 1,000
    assert "No messages" in ok(server, "queue", "peek", name, "-n", str(2**63))
    assert "out of range" in fails(server, "apikey", "create", "k", "--expires-in", "999999999d")
    assert "not valid text" in fails(server, "queue", "create", "\udcff")
    assert "not valid text" in fails(server, "enqueue", name, "-H", "k=\udcff", "x")
    long_host = "a" * 64 + ":5555"
    assert "not valid text" in fails(long_host, "queue", "list")


def test_a_watch_interval_must_be_a_number_of_seconds(server: ServerProcess) -> None:
    for bad in ("nan", "inf", "0.01"):
        result = fila(server, "queue", "list", "--watch", "--iterations", "3", "--interval", bad)
        assert result.exit_code == 2, (bad, result.stderr)


def test_a_url_as_the_address_gets_the_host_port_it_meant(server: ServerProcess) -> None:
    line = fails(f"http://{server.addr}", "queue", "list")
    assert "is a URL" in line and f"e.g. {server.addr}" in line and "IPv6" not in line


def test_usage_errors_keep_exit_2(server: ServerProcess) -> None:
    assert fila(server, "queue", "create").exit_code == 2
    assert fila(server, "queue", "create", "q", "--visibility-timeout", "soon").exit_code == 2


def test_subprocess_error_has_no_traceback() -> None:
    proc = run_fila("--addr", f"127.0.0.1:{free_port()}", "queue", "list")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "connection refused" in one_error_line(proc.stderr)


def test_subprocess_json_against_server(server: ServerProcess) -> None:
    name = unique("sp")
    created = run_fila("--addr", server.addr, "--json", "queue", "create", name)
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["name"] == name
    listed = run_fila("--addr", server.addr, "queue", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert name in {q["name"] for q in json.loads(listed.stdout)}


def test_addr_from_environment(server: ServerProcess) -> None:
    result = CliRunner().invoke(cli, ["--json", "queue", "list"], env={"FILA_ADDR": server.addr})
    assert result.exit_code == 0, result.stderr
    assert isinstance(json.loads(result.stdout), list)


def test_mtls_and_api_key(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
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

        no_key = fails(srv, *tls, "queue", "list")
        assert "missing API key" in no_key
        assert "--api-key" in no_key and "FILA_API_KEY" in no_key
        wrong_key = fails(srv, *tls, "--api-key", "not-the-key", "queue", "list")
        assert "unknown or revoked API key" in wrong_key
        assert "check the key passed with --api-key or FILA_API_KEY" in wrong_key
        # No client certificate: the broker refuses the handshake. Depending on the TLS
        # version that surfaces while connecting or on the first call; one line either way.
        no_cert = fails(
            srv, "--tls", "--ca-cert", str(certs["ca.pem"]), "--api-key", key, "queue", "list"
        )
        assert "requires a client certificate" in no_cert and "--client-cert" in no_cert
        assert "together" in fails(srv, "--client-cert", str(certs["client.pem"]), "queue", "list")


def test_version() -> None:
    for run in (CliRunner().invoke(cli, ["--version"]), run_fila("--version")):
        exit_code = run.exit_code if hasattr(run, "exit_code") else run.returncode
        assert exit_code == 0
        assert run.stdout == f"fila {__version__}\n"


def _leaf_commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += _leaf_commands(command, (*path, name))
        else:
            found.append((*path, name))
    return found


def test_every_command_takes_json_after_its_name() -> None:
    """Structure, so a command added later (in any group) cannot miss the flag."""
    assert isinstance(cli, click.Group)
    leaves = _leaf_commands(cli)
    assert len(leaves) >= 18
    # A long-running server prints no document; it takes `fila`'s connection options.
    serving = {("dashboard",)}
    for path in leaves:
        if path in serving:
            continue
        command = cli
        for name in path:
            assert isinstance(command, click.Group)
            command = command.commands[name]
        assert isinstance(command, Command), path
        assert any("--json" in p.opts for p in command.params), path


def test_json_before_and_after_the_subcommand(server: ServerProcess, tmp_path: Path) -> None:
    """The same command with --json in either position prints the same document."""
    name = unique("pos")
    dlq = f"{name}.dlq"
    assert ok_json(server, "queue", "create", name)["name"] == name
    payload = tmp_path / "p.txt"
    payload.write_text("from a file")
    enqueued = json.loads(ok(server, "enqueue", name, f"@{payload}", "--json"))
    assert enqueued["queue"] == name and enqueued["message_id"]
    ok(server, "config", "set", f"{name}.k", "v", "--json")
    both = [
        ("queue", "list"),
        ("queue", "inspect", name),
        ("queue", "peek", name),
        ("queue", "peek", dlq),
        ("config", "get", f"{name}.k"),
        ("config", "list", "--prefix", name),
        ("redrive", dlq),
        ("health",),
    ]
    for args in both:
        before = ok_json(server, *args)
        after = json.loads(ok(server, *args, "--json"))
        if args[:2] == ("queue", "list"):
            before = [q for q in before if q["name"].startswith(name)]
            after = [q for q in after if q["name"].startswith(name)]
        assert before == after, args
    assert json.loads(ok(server, "queue", "purge", dlq, "--yes", "--json")) == {
        "queue": dlq,
        "purged": 0,
    }
    assert ok_json(server, "queue", "delete", name, "-y") == {"name": name, "deleted": True}


def test_usage_errors_are_one_line_and_exit_2(server: ServerProcess) -> None:
    line = fails(server, "queue", "list", "--jsn", code=2)
    assert "No such option" in line and "fila queue list --help" in line
    assert "Missing argument" in fails(server, "queue", "create", code=2)
    assert "No such command" in fails(server, "queeu", code=2)
    assert "--bogus" in fails(server, "--bogus", "queue", "list", code=2)
    # A bare group still shows its help (click's behaviour), not an error line.
    result = fila(server, "queue")
    assert "Commands:" in result.stdout + result.stderr


def test_grpc_core_logs_never_reach_the_terminal(server: ServerProcess) -> None:
    """--tls against a plaintext broker makes gRPC's C core log every failed handshake
    (with GRPC_VERBOSITY unset it prints them at INFO): the user sees one line only."""
    proc = run_fila("--addr", server.addr, "--tls", "queue", "list", env=clean_env())
    assert proc.returncode == 1
    line = one_error_line(proc.stderr)
    assert "not serving TLS" in line and "drop --tls" in line
