"""Running the `fila` command in tests: in-process (click's CliRunner) for output and
exit codes, and as a real subprocess where the process itself matters (gRPC's C-core
logging, stdin being a terminal, Ctrl-C, commands that run until stopped).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import queue
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import pytest
from click.testing import CliRunner, Result

from fila.cli import cli
from fila.testing.server import ServerProcess

PROCESS_TIMEOUT_S = 60.0


def target(server: ServerProcess | str) -> str:
    return server if isinstance(server, str) else server.addr


def fila(
    server: ServerProcess | str,
    *args: str,
    env: Mapping[str, str] | None = None,
    input: str | bytes | None = None,
) -> Result:
    """`fila --addr <server> ARGS...` in-process."""
    return CliRunner().invoke(
        cli, ["--addr", target(server), *args], prog_name="fila", env=env, input=input
    )


def ok(server: ServerProcess | str, *args: str, input: str | bytes | None = None) -> str:
    result = fila(server, *args, input=input)
    assert result.exit_code == 0, (result.stdout, result.stderr, result.exception)
    assert result.stderr == ""
    return result.stdout


def ok_json(server: ServerProcess | str, *args: str) -> Any:
    """The command with `--json` before the subcommand, its stdout decoded."""
    return json.loads(ok(server, "--json", *args))


def fails(server: ServerProcess | str, *args: str, code: int = 1) -> str:
    """Run a failing command; return its single stderr line."""
    result = fila(server, *args)
    assert result.exit_code == code, (result.stdout, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit)  # no uncaught exception
    return one_error_line(result.stderr)


def one_error_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fila: error: "), stderr
    return lines[0]


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without FILA_* and gRPC logging settings, so what the
    subprocess prints is what a user with a plain shell would see."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("FILA_", "GRPC_VERBOSITY", "GRPC_TRACE"))
    }
    env.update(extra)
    return env


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "fila.cli", *args]


def run_fila(
    *args: str, env: Mapping[str, str] | None = None, input: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    """`fila ARGS...` as a real process (the console script's code path)."""
    return subprocess.run(
        command(*args),
        input=input.decode() if input is not None else None,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        check=False,
        env=dict(env) if env is not None else clean_env(),
    )


class Lines:
    """Reads a stream line by line on a thread, so a test can wait for a line with a
    deadline instead of blocking forever on a process that printed nothing."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def next(self, timeout: float = 20.0) -> str:
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no line within {timeout}s; seen so far: {self.seen}") from None
        if line is None:
            self._queue.put(None)
            raise EOFError(f"stream ended; seen: {self.seen}")
        self.seen.append(line)
        return line

    def rest(self, timeout: float = 20.0) -> list[str]:
        """Every remaining line until the stream ends."""
        lines = []
        while True:
            try:
                lines.append(self.next(timeout))
            except EOFError:
                return lines


class Running:
    """A `fila` subprocess that runs until it stops itself or is interrupted."""

    def __init__(self, *args: str, env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            command(*args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env) if env is not None else clean_env(),
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.stdout = Lines(self.proc.stdout)
        self.stderr = Lines(self.proc.stderr)

    def interrupt(self) -> int:
        """Ctrl-C, as a terminal sends it; returns the exit status."""
        self.proc.send_signal(signal.SIGINT)
        return self.wait()

    def wait(self, timeout: float = PROCESS_TIMEOUT_S) -> int:
        return self.proc.wait(timeout)

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_in_terminal(
    *args: str,
    stdin_text: bytes = b"",
    stdout_terminal: bool = False,
    env: Mapping[str, str] | None = None,
) -> tuple[int, str, str]:
    """`fila ARGS...` with stdin (and optionally stdout) on a pseudo-terminal, as a
    user at a shell runs it; `stdin_text` is typed in. Returns (status, stdout, stderr).
    """
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        command(*args),
        stdin=slave,
        stdout=slave if stdout_terminal else subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env) if env is not None else clean_env(TERM="xterm-256color"),
    )
    os.close(slave)
    os.write(master, stdin_text)
    captured = bytearray()

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every slave end closed (the process exited)
                return
            if not chunk:
                return
            captured.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        out, err = proc.communicate(timeout=PROCESS_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    os.close(master)
    stdout = captured.decode(errors="replace") if stdout_terminal else out.decode()
    return proc.returncode, stdout, err.decode()


def make_certs(root: Path) -> dict[str, Path]:
    """A throwaway CA, a server cert for 127.0.0.1 and a client cert, via openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True)

    days = ["-days", "1"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", *days, "-subj", "/CN=test-ca")
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
            *days,
            *ext,
        )
    names = ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    return {name: root / name for name in names}
