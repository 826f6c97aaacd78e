"""Run a real `fila-server` as a child process: the harness of the tests and the benchmark.

Both exercise the broker the way an operator runs it, through `python -m
fila.server.main`, its config file and its environment, so startup, signal handling and
crash recovery are covered by the same code path users hit. Readiness is the standard
`grpc.health.v1.Health/Check` answering SERVING, polled against a deadline; a child that
dies or never becomes ready raises `ServerStartError` with the tail of its log.

The port is picked once and kept, so `kill()` followed by `restart()` brings the broker
back on the same address and data directory, as a crash and a supervisor restart would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import fila
from fila.testing.children import free_port, kill_child, stop_child

_REPO_ROOT = Path(fila.__file__).resolve().parent.parent
_LOG_TAIL_LINES = 40
# The start-up probe's channel retries a refused connection every 50 ms, not on gRPC's
# growing backoff: with a 200 ms cap a broker that began listening just after an attempt
# waited up to the cap more to be seen (start to SERVING: docs/benchmarks.md).
_FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 50),
]


class ServerStartError(RuntimeError):
    """The broker exited or did not report SERVING before the deadline."""


class ServerProcess:
    """One broker child process bound to a data directory and a fixed port.

    `config_toml` is written to `data_dir.parent / "fila.toml"` and passed as
    `--config`; `persist_mode`, when given, is set in that file's `[storage]` table.
    `env` adds to (and may override) the child's environment, from which inherited
    `FILA_*` variables (and gRPC's log settings) are removed so the caller's shell cannot
    leak into a test. The child runs the `fila` this process imported: its checkout comes
    first on the child's `PYTHONPATH`, whatever the caller's `PYTHONPATH` says (so an A/B
    driver must import `fila` from the side it measures, as `scripts/ab_harness.py`
    does with one process per side).
    `channel_credentials` are used for the readiness check when the config enables TLS.
    `wrapper` is an argv prefix the broker runs under (e.g. `strace -f -o FILE`, or
    `ip netns exec NS` with `host` an address inside that namespace). `port` fixes the
    port in advance (a cluster node's advertised address must be known to write its
    config); by default a free one is picked.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        config_toml: str | None = None,
        env: dict[str, str] | None = None,
        persist_mode: str | None = None,
        channel_credentials: grpc.ChannelCredentials | None = None,
        wrapper: list[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port if port is not None else free_port()
        self.log_path = self.data_dir.parent / "fila-server.log"
        self.config_path: Path | None = None
        self._credentials = channel_credentials
        self._wrapper = wrapper or []
        self._proc: subprocess.Popen[bytes] | None = None
        self._starts = 0
        if persist_mode is not None:
            config_toml = _with_persist_mode(config_toml or "", persist_mode)
        if config_toml is not None:
            self.config_path = self.data_dir.parent / "fila.toml"
        self._config_toml = config_toml
        # Not this process's own settings for Fila or gRPC (the `fila` CLI, once
        # imported, sets GRPC_VERBOSITY): the broker starts from its own defaults.
        inherited = ("FILA_", "GRPC_VERBOSITY", "GRPC_TRACE")
        self._env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
        self._env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        self._env["PYTHONUNBUFFERED"] = "1"
        self._env["FILA_DATA_DIR"] = str(self.data_dir)
        self._env["FILA_LISTEN_ADDR"] = self.addr
        self._env.update(env or {})

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("fila-server was never started")
        return self._proc.pid

    def log_text(self) -> str:
        """Everything the broker printed, across all starts, one marker line per start."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, timeout: float = 20.0) -> ServerProcess:
        """Launch the broker and return once Health/Check answers SERVING."""
        if self.running:
            raise RuntimeError(f"fila-server already running (pid {self.pid})")
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        argv = [*self._wrapper, sys.executable, "-m", "fila.server.main"]
        if self.config_path is not None and self._config_toml is not None:
            self.config_path.write_text(self._config_toml, encoding="utf-8")
            argv += ["--config", str(self.config_path)]
        self._starts += 1
        with self.log_path.open("ab") as log:
            log.write(f"--- harness: start #{self._starts} on {self.addr} ---\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                argv,
                cwd=self.data_dir.parent,
                env=self._env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_serving(time.monotonic() + timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM (graceful shutdown) and wait; returns the exit code.

        A broker that does not exit in time is SIGKILLed and `TimeoutError` raised, so
        a hung shutdown fails the test instead of passing silently.
        """
        proc = self._started()
        if not stop_child(proc, timeout):
            raise TimeoutError(
                f"fila-server did not exit within {timeout}s of SIGTERM\n{self._tail()}"
            )
        return proc.returncode

    def kill(self) -> int:
        """SIGKILL (a crash) and wait; returns the exit code."""
        return kill_child(self._started())

    def restart(self, timeout: float = 20.0) -> ServerProcess:
        """Stop if running, then start again on the same port and data directory."""
        if self.running:
            self.stop()
        return self.start(timeout)

    def __enter__(self) -> ServerProcess:
        return self if self.running else self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.running:
            self.stop()

    def _started(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError("fila-server was never started")
        return self._proc

    def _wait_serving(self, deadline: float) -> None:
        proc = self._started()
        serving = health_pb2.HealthCheckResponse.SERVING
        with self._channel() as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            last = "no answer"
            while (remaining := deadline - time.monotonic()) > 0:
                if proc.poll() is not None:
                    raise ServerStartError(
                        f"fila-server exited with code {proc.returncode} before serving\n"
                        f"{self._tail()}"
                    )
                try:
                    reply = check(
                        health_pb2.HealthCheckRequest(service=""),
                        timeout=min(0.5, remaining),
                        wait_for_ready=True,
                    )
                except grpc.RpcError as exc:
                    last = str(exc.code())
                else:
                    if reply.status == serving:
                        return
                    last = f"status {reply.status}"
                time.sleep(0.05)  # not ready yet: poll again shortly
        raise ServerStartError(
            f"fila-server on {self.addr} not SERVING before the deadline ({last})\n{self._tail()}"
        )

    def _channel(self) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(self.addr, options=_FAST_RECONNECT)
        return grpc.secure_channel(self.addr, self._credentials, options=_FAST_RECONNECT)

    def _tail(self) -> str:
        lines = self.log_text().splitlines()[-_LOG_TAIL_LINES:]
        return f"--- last {len(lines)} lines of {self.log_path} ---\n" + "\n".join(lines)


def _with_persist_mode(config_toml: str, persist_mode: str) -> str:
    """Re-emit a (flat, sectioned) config with `storage.persist_mode` set."""
    doc = tomllib.loads(config_toml)
    doc.setdefault("storage", {})["persist_mode"] = persist_mode
    out: list[str] = []
    for section, table in doc.items():
        out.append(f"[{section}]")
        out += [f"{key} = {_toml_value(value)}" for key, value in table.items()]
    return "\n".join(out) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return json.dumps(value)  # JSON strings and numbers are valid TOML
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise ValueError(f"cannot re-emit TOML value {value!r}")
