"""The CLI's job-queue conveniences against a real broker: duration flags that take
`5m` (a plain number keeping its old unit), `queue delete` asking first, and shell
completion as the README documents it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from support import unique
from support.cli import clean_env, fails, fila, ok, ok_json, run_in_terminal

from fila.durations import parse_ms
from fila.testing.server import ServerProcess
from fila_sdk import Client, QueueNotFoundError


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.addr) as c:
        yield c


def test_durations_take_units_and_plain_milliseconds() -> None:
    assert [parse_ms(t) for t in ("250ms", "30s", "5m", "1h30m", "2d", "1500", " 7 ")] == [
        250,
        30_000,
        300_000,
        5_400_000,
        172_800_000,
        1500,
        7,
    ]
    for bad in ("5x", "1.5s", "-3", "", "m", "30s5"):
        with pytest.raises(ValueError):
            parse_ms(bad)


def test_every_duration_flag_takes_units(server: ServerProcess, client: Client) -> None:
    name = unique("dur")
    ok(server, "queue", "create", name, "--visibility-timeout", "5m")
    delayed = ok_json(server, "enqueue", name, "--delay", "1500", "later")
    assert delayed["delay_ms"] == 1500  # a plain number is still milliseconds
    assert ok_json(server, "enqueue", name, "--delay", "2m", "x")["delay_ms"] == 120_000
    watched = ok(server, "queue", "inspect", name, "--watch", "--interval", "150ms",
                 "--iterations", "1")  # fmt: skip
    assert name in watched
    assert name in ok(server, "queue", "list", "--watch", "--interval", "0.2", "--iterations", "1")
    line = fails(server, "queue", "create", unique("bad"), "--visibility-timeout", "5x", code=2)
    assert '"5x" is not a duration' in line and "5m" in line
    line = fails(server, "queue", "inspect", name, "--watch", "--interval", "50ms", code=2)
    assert "between 100ms and 1d" in line
    assert "--expires-in" in ok(server, "apikey", "create", "--help")


def test_queue_delete_needs_yes_without_a_terminal(server: ServerProcess, client: Client) -> None:
    name = unique("keep")
    client.create_queue(name)
    client.enqueue(name, b"precious")
    line = fails(server, "queue", "delete", name)
    assert f'refusing to delete "{name}" without --yes' in line and "not a terminal" in line
    result = fila(server, "queue", "delete", name, input="y\n")
    assert result.exit_code == 1 and "without --yes" in result.stderr
    assert client.get_stats(name).depth == 1
    assert ok(server, "queue", "delete", name, "--yes") == f'Deleted queue "{name}"\n'
    with pytest.raises(QueueNotFoundError):
        client.get_stats(name)


def test_queue_delete_asks_on_a_terminal(server: ServerProcess, client: Client) -> None:
    name = unique("ask")
    client.create_queue(name)
    client.enqueue(name, b"a")
    args = ("--addr", server.addr, "queue", "delete", name)
    status, out, err = run_in_terminal(*args, stdin_text=b"n\n")
    assert status == 1 and out == ""
    assert f'Delete queue "{name}", its 1 message(s) and its dead-letter queue?' in err
    assert err.rstrip().endswith(f'fila: error: delete of "{name}" cancelled; nothing was deleted')
    assert client.get_stats(name).depth == 1
    status, out, err = run_in_terminal(*args, stdin_text=b"y\n")
    assert status == 0, err
    assert out == f'Deleted queue "{name}"\n'
    with pytest.raises(QueueNotFoundError):
        client.get_stats(name)


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shell_completion_scripts_come_from_the_documented_variable(shell: str) -> None:
    fila_bin = os.path.join(os.path.dirname(sys.executable), "fila")
    script = subprocess.run(
        [fila_bin],
        env=clean_env(_FILA_COMPLETE=f"{shell}_source"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "_FILA_COMPLETE" in script
    completed = subprocess.run(
        [fila_bin],
        env=clean_env(_FILA_COMPLETE="bash_complete", COMP_WORDS="fila queue de", COMP_CWORD="2"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "plain,delete" in completed.split()
