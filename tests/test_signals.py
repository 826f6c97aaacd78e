"""Signals a broker gets besides SIGTERM: SIGHUP (a closed terminal, some supervisors)
stops it gracefully, SIGUSR1/SIGUSR2 are ignored with a warning, and a stop signal
while it starts ends it with one line and exit code 0, its data as it was.

Each used to kill the broker: SIGHUP and SIGUSR1/2 at once, with no drain and no log
line; SIGINT during startup with a 28-line traceback, SIGTERM silently with -15."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import ServerFactory, wait_until
from support.cli import Lines
from support.stubs import connect

EXIT_DEADLINE_S = 10.0


def test_sighup_stops_the_broker_gracefully(server_factory: ServerFactory) -> None:
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("kept")
        fila.enqueue("kept", b"m")
    os.kill(server.pid, signal.SIGHUP)
    wait_until(lambda: not server.running, EXIT_DEADLINE_S, what="exit after SIGHUP")
    assert server.stop() == 0  # the exit code of the stop that already happened
    log = server.log_text()
    assert "Traceback" not in log
    shutting = [line for line in log.splitlines() if 'msg="shutting down"' in line]
    assert len(shutting) == 1 and "signal=SIGHUP" in shutting[0], log[-2000:]
    assert "msg=stopped" in log
    server.start()
    with connect(server.addr) as fila:
        assert fila.stats("kept").depth == 1


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2], ids=lambda s: s.name)
def test_sigusr1_and_sigusr2_are_ignored_with_one_warning(
    server_factory: ServerFactory, sig: signal.Signals
) -> None:
    server = server_factory()
    os.kill(server.pid, sig)
    wait_until(
        lambda: f"ignored {sig.name}" in server.log_text() or not server.running,
        EXIT_DEADLINE_S,
        what=f"the {sig.name} warning",
    )
    assert server.running, server.log_text()[-2000:]
    lines = [line for line in server.log_text().splitlines() if f"ignored {sig.name}" in line]
    assert len(lines) == 1 and "level=warning" in lines[0]
    assert "no meaning for fila-server" in lines[0]
    with connect(server.addr) as fila:  # still serving
        fila.create_queue("after")
        fila.enqueue("after", b"m")
    assert server.stop() == 0


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name
)
def test_a_stop_signal_while_starting_ends_it_with_one_line_and_exit_0(
    server_factory: ServerFactory, tmp_path: Path, sig: signal.Signals
) -> None:
    """The start is held where storage opens: a FIFO where the direct-I/O probe writes
    blocks its open until a reader comes, which none does. That is inside the window
    where recovery runs, without building a data directory large enough to be caught
    in it by timing."""
    server = server_factory()
    with connect(server.addr) as fila:
        fila.create_queue("kept")
        for i in range(20):
            fila.enqueue("kept", f"m{i}".encode())
    assert server.stop() == 0
    probe = server.data_dir / ".direct-io-probe"
    os.mkfifo(probe)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FILA_")}
    env.update(FILA_DATA_DIR=str(server.data_dir), FILA_LISTEN_ADDR=server.addr)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH")) if p
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "fila.server.main"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        lines = Lines(proc.stderr)
        # logged once the startup handlers are in place; storage opens after it
        while 'msg="config loaded"' not in lines.next(EXIT_DEADLINE_S):
            pass
        proc.send_signal(sig)
        code = proc.wait(EXIT_DEADLINE_S)
        rest = lines.rest(EXIT_DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0, rest
    assert rest == [
        f"fila-server: stopped by {sig.name} while starting, before serving; stored data is "
        "as it was"
    ]
    probe.unlink()
    server.start()
    with connect(server.addr) as fila:
        assert fila.stats("kept").depth == 20
