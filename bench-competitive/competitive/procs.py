"""Starting, watching and stopping broker processes, and finding any we left behind.

Every broker runs in a session (process group) of its own, pinned with `taskset` to
the broker CPU, with its output in a log file inside its temporary directory, where
`broker.json` also records its pid and start time. A broker's processes are those of
its session plus those carrying its value of the environment variable
`BENCH_COMPETITIVE_RUN`, which children inherit: the marker finds helpers that leave
the session (the Erlang port mapper `epmd` daemonizes into one of its own), the
session finds processes that overwrite their environment (Redis rewrites that memory
for its process title). `bench-clean` uses both, through the `broker.json` files of
temporary directories a killed run left behind. Processes are only ever signalled by
pid, and only when they belong to a broker this harness started.

Readiness is always a real check (a protocol round trip) polled against a deadline,
and a broker that exits while we wait fails at once with the tail of its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

MARKER: Final = "BENCH_COMPETITIVE_RUN"
TMP_PREFIX: Final = "fila-bench-competitive-"
RECORD: Final = "broker.json"
_POLL_S: Final = 0.05
_LOG_TAIL_LINES: Final = 30


class BrokerStartError(RuntimeError):
    """The broker exited, or did not become ready before its deadline."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (held open together, so none is picked twice)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def temp_dir(label: str, root: Path | None = None) -> Iterator[Path]:
    """A fresh directory under `root` (the system temp dir), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{label}-", dir=root))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """How to start one broker: command, extra environment, working directory."""

    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    # Inherited variables starting with one of these are not passed on (e.g. "FILA_",
    # so a developer's shell cannot switch on auth or move the data directory).
    drop_env_prefixes: tuple[str, ...] = ()


class BrokerProcess:
    """One broker process group started from a `LaunchSpec`."""

    def __init__(self, name: str, spec: LaunchSpec, *, cpu: int | None, instance: str) -> None:
        self.name = name
        self.instance = instance  # the marker value: unique per broker start
        self.log_path = spec.cwd / f"{name}.log"
        self._spec = spec
        self._cpu = cpu
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        argv = list(self._spec.argv)
        if self._cpu is not None and shutil.which("taskset"):
            argv = ["taskset", "-c", str(self._cpu), *argv]
        inherited = {
            k: v for k, v in os.environ.items() if not k.startswith(self._spec.drop_env_prefixes)
        }
        env = {**inherited, **self._spec.env, MARKER: self.instance}
        self._spec.cwd.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                argv,
                cwd=self._spec.cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        record = {
            "pid": self._proc.pid,
            "start": start_time(self._proc.pid),
            "instance": self.instance,
        }
        (self._spec.cwd / RECORD).write_text(json.dumps(record), encoding="utf-8")

    async def wait_ready(
        self, probe: Callable[[], Awaitable[bool]], timeout_s: float, what: str
    ) -> float:
        """Polls `probe` until it answers True; returns the seconds it took.

        `probe` must itself be bounded in time (each adapter gives its connection
        attempts a short timeout), so the deadline holds.
        """
        started = time.monotonic()
        deadline = started + timeout_s
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            if not self.running:
                code = self._proc.returncode if self._proc is not None else None
                raise BrokerStartError(
                    f"{self.name} exited with code {code} before {what}\n{self.tail()}"
                )
            try:
                if await probe():
                    return time.monotonic() - started
            except (TimeoutError, OSError) as exc:
                last_error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(_POLL_S)  # poll interval, bounded by the deadline above
        raise BrokerStartError(
            f"{self.name}: no {what} within {timeout_s:g}s ({last_error})\n{self.tail()}"
        )

    def terminate(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the group, wait, then SIGKILL it and any marked helper left over."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(5)
        self.kill_leftovers()

    def wait_exit(self, timeout_s: float) -> bool:
        """True once the main process exited (after a broker-specific stop command)."""
        if self._proc is None:
            return True
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def members(self) -> set[int]:
        """The broker's processes now: its session, plus marked helpers."""
        return members(self.instance, self.pid if self._proc is not None else None)

    def kill_leftovers(self) -> list[int]:
        """SIGKILL every process of this broker that is still there; returns pids."""
        sid = self._proc.pid if self._proc is not None else None
        return _kill(members(self.instance, sid))

    def tail(self) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return f"(no log at {self.log_path})"
        shown = lines[-_LOG_TAIL_LINES:]
        return f"--- last {len(shown)} lines of {self.log_path} ---\n" + "\n".join(shown)


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (field 3 onwards)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (tells a reused pid apart)."""
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, ValueError, IndexError):
        return None


def members(instance: str, sid: int | None) -> set[int]:
    """Processes in session `sid`, plus those carrying marker value `instance`."""
    found: set[int] = set()
    for pid in _pids():
        try:
            if sid is not None and int(_stat_fields(pid)[3]) == sid:
                found.add(pid)
        except (OSError, ValueError, IndexError):
            continue
    found |= {pid for pid, value in marked_processes().items() if value == instance}
    found.discard(os.getpid())
    return found


def _pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def _kill(pids: set[int]) -> list[int]:
    killed: list[int] = []
    for pid in sorted(pids):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def marked_processes() -> dict[int, str]:
    """pid -> marker value of every process that carries the harness marker."""
    needle = f"{MARKER}=".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours to read
            continue
        for var in environ.split(b"\0"):
            if var.startswith(needle):
                found[int(entry.name)] = var[len(needle) :].decode(errors="replace")
                break
    found.pop(os.getpid(), None)
    return found


def stray_dirs(root: Path | None = None) -> list[Path]:
    """Temporary directories left by harness runs (removed by `bench-clean`)."""
    return sorted(Path(root or tempfile.gettempdir()).glob(f"{TMP_PREFIX}*"))


def clean(root: Path | None = None) -> tuple[list[int], list[Path]]:
    """Kills what killed runs left running and removes their directories.

    A directory whose `broker.json` names a runner that is still alive belongs to a
    run in progress (someone else's, on a shared machine) and is left alone. Otherwise
    the recorded broker is killed with its session, but only if its pid still has the
    recorded start time (a reused pid is never touched). With the default `root` (the
    system temp dir), any other process carrying the marker of a run that is not in
    progress is killed too. Returns (pids killed, directories removed).
    """
    doomed: set[int] = set()
    live_instances: set[str] = set()
    removable: list[Path] = []
    for d in stray_dirs(root):
        records = [_read_record(p) for p in d.rglob(RECORD)]
        if any(r is not None and _alive(r["runner_pid"], r["runner_start"]) for r in records):
            live_instances |= {str(r["instance"]) for r in records if r is not None}
            continue
        removable.append(d)
        for r in records:
            if r is not None:
                alive = _alive(r["pid"], r["start"])
                doomed |= members(str(r["instance"]), int(r["pid"]) if alive else None)
    if root is None:
        doomed |= {p for p, v in marked_processes().items() if v not in live_instances}
    killed = _kill(doomed)
    for d in removable:
        shutil.rmtree(d, ignore_errors=True)
    return killed, removable


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    keys = ("pid", "start", "instance", "runner_pid", "runner_start")
    if not isinstance(record, dict) or any(k not in record for k in keys):
        return None
    return record


def _alive(pid: object, started: object) -> bool:
    """True if `pid` runs and is the process that started at `started`."""
    if not isinstance(pid, int) or started is None:
        return False
    now = start_time(pid)
    return now is not None and now == started
