"""Run a real etcd (one member, or several forming a cluster) as child processes: the
etcd the cluster tests, the cluster benchmark and docs/cluster.md's walkthrough use.

Debian's `etcd-server` package provides `/usr/bin/etcd` (3.4). Each member gets its
own data directory and free ports; `start()` returns once every member answers
`/health` with `{"health": "true"}` (so the cluster has a leader and quorum), and
`stop()` ends them all, killing what does not exit in time. Members can run inside a
network namespace (`wrapper=["ip", "netns", "exec", NS]`) and listen for clients on
more addresses than the one they advertise (`extra_client_hosts`), which the
fencing test uses to give a node its own link to etcd.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from fila.testing.children import free_port, stop_child

_START_ATTEMPTS = 3
_ADDRESS_IN_USE = "address already in use"  # etcd's log line when a port was taken


class EtcdStartError(RuntimeError):
    """etcd is not installed, exited, or did not report healthy in time."""


def etcd_binary() -> str | None:
    return shutil.which("etcd")


class EtcdCluster:
    def __init__(
        self,
        root: Path,
        members: int = 1,
        *,
        host: str = "127.0.0.1",
        extra_client_hosts: tuple[str, ...] = (),
        wrapper: list[str] | None = None,
    ) -> None:
        binary = etcd_binary()
        if binary is None:
            raise EtcdStartError("etcd is not installed (Debian: apt-get install etcd-server)")
        self._binary = binary
        self.root = Path(root)
        self.host = host
        self._extra = extra_client_hosts
        self._wrapper = wrapper or []
        self._names = [f"m{i}" for i in range(members)]
        self._client = [free_port() for _ in self._names]
        self._peer = [free_port() for _ in self._names]
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * members

    @property
    def endpoints(self) -> list[str]:
        """host:port of every member, as `[cluster] etcd_endpoints` wants them."""
        return [f"{self.host}:{port}" for port in self._client]

    def endpoints_on(self, host: str) -> list[str]:
        """The members' client endpoints on another of their listening addresses."""
        return [f"{host}:{port}" for port in self._client]

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Starts every member and waits until all are healthy. A port chosen free can
        be taken before a member binds it (by another process, or as the local port of
        a connection between the members that started first): the whole cluster is
        then started again, from empty data directories, on new ports."""
        self.root.mkdir(parents=True, exist_ok=True)
        for attempt in range(_START_ATTEMPTS):
            initial = ",".join(
                f"{name}=http://{self.host}:{port}"
                for name, port in zip(self._names, self._peer, strict=True)
            )
            for index, name in enumerate(self._names):
                self._start_member(index, name, initial, "new")
            try:
                self._wait_healthy(time.monotonic() + timeout)
                return self
            except EtcdStartError as exc:
                if _ADDRESS_IN_USE not in str(exc) or attempt == _START_ATTEMPTS - 1:
                    raise
            self.stop()
            for name in self._names:  # the logs are kept, renamed, for the record
                shutil.rmtree(self.root / name, ignore_errors=True)
                log = self.root / f"{name}.log"
                if log.exists():
                    log.rename(self.root / f"{name}.attempt{attempt + 1}.log")
            self._client = [free_port() for _ in self._names]
            self._peer = [free_port() for _ in self._names]
        raise AssertionError("unreachable")

    def _start_member(self, index: int, name: str, initial: str, state: str) -> None:
        client, peer = self._client[index], self._peer[index]
        listen = ",".join(f"http://{h}:{client}" for h in (self.host, *self._extra))
        argv = [
            *self._wrapper,
            self._binary,
            "--name", name,
            "--data-dir", str(self.root / name),
            "--listen-client-urls", listen,
            "--advertise-client-urls", f"http://{self.host}:{client}",
            "--listen-peer-urls", f"http://{self.host}:{peer}",
            "--initial-advertise-peer-urls", f"http://{self.host}:{peer}",
            "--initial-cluster", initial,
            "--initial-cluster-state", state,
            "--initial-cluster-token", f"fila-{self.root.name}",
            "--logger", "zap",
            "--log-level", "warn",
        ]  # fmt: skip
        with (self.root / f"{name}.log").open("ab") as log:
            self._procs[index] = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def _wait_healthy(self, deadline: float) -> None:
        last = "no answer"
        while time.monotonic() < deadline:
            for index, proc in enumerate(self._procs):
                if proc is not None and proc.poll() is not None:
                    raise EtcdStartError(
                        f"etcd member {self._names[index]} exited with {proc.returncode}\n"
                        + self.log_tail(index)
                    )
            healthy = [self._healthy(port) for port in self._client]
            if all(h is True for h in healthy):
                return
            last = str(healthy)
            time.sleep(0.05)  # poll again shortly; the deadline bounds the wait
        self.stop()
        raise EtcdStartError(f"etcd not healthy before the deadline ({last})\n{self.log_tail(0)}")

    def _healthy(self, port: int) -> bool | str:
        try:
            with urllib.request.urlopen(f"http://{self.host}:{port}/health", timeout=1) as reply:
                return bool(json.loads(reply.read()).get("health") == "true")
        except (OSError, urllib.error.URLError, ValueError) as exc:
            return type(exc).__name__

    def leader(self) -> int:
        """The index of the member that leads the raft group now, so that a test can
        stop a follower (its loss costs no election) or the leader on purpose. Asks
        every member (all must answer) for its id and the leader's."""
        ids: list[str] = []
        leaders: set[str] = set()
        for port in self._client:
            request = urllib.request.Request(
                f"http://{self.host}:{port}/v3/maintenance/status", data=b"{}", method="POST"
            )
            with urllib.request.urlopen(request, timeout=2) as reply:
                status = json.loads(reply.read())
            ids.append(status["header"]["member_id"])
            leaders.add(status["leader"])
        if len(leaders) != 1 or not leaders <= set(ids):
            raise EtcdStartError(f"etcd members disagree on their leader: {sorted(leaders)}")
        return ids.index(leaders.pop())

    def pid(self, index: int) -> int:
        """The process id of member `index` (a test hangs one with SIGSTOP)."""
        proc = self._procs[index]
        if proc is None:
            raise EtcdStartError(f"etcd member {index} is not running")
        return proc.pid

    def log_tail(self, index: int, lines: int = 20) -> str:
        path = self.root / f"{self._names[index]}.log"
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            return ""
        return "\n".join(text)

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the members one after another. A leader that is stopped hands its
        leadership over first; stopped all at once, it waited out etcd's request
        timeout (7 s) for a member that was exiting too, on every three-member stop."""
        for proc in self._procs:
            if proc is not None:
                stop_child(proc, timeout)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
