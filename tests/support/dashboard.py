"""Run `python -m fila.dashboard` as a child process, as an operator would.

The tests drive the real command (option parsing, the loopback/token rule, uvicorn),
not an in-process app, so what they see is what `fila dashboard` serves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from fila.testing.children import free_port, stop_child

_REPO_ROOT = Path(__file__).resolve().parents[2]


class DashboardProcess:
    def __init__(
        self,
        broker_addr: str,
        log_path: Path,
        *,
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        sample_interval: float = 0.5,
    ) -> None:
        self.host = host
        self.port = free_port()
        self.log_path = log_path
        self.argv = [
            sys.executable,
            "-m",
            "fila.dashboard",
            "--listen",
            f"{host}:{self.port}",
            "--addr",
            broker_addr,
            "--sample-interval",
            str(sample_interval),
            *(extra_args or []),
        ]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FILA_")}
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(_REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.update(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where a browser on this machine reaches it (loopback even when bound to 0.0.0.0)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> DashboardProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=_REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dashboard exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/healthz", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)  # polling for readiness against the deadline above
        self.stop()
        raise TimeoutError(f"dashboard not answering /healthz within {timeout}s:\n{self.log()}")

    def run_to_exit(self, timeout: float = 30.0) -> tuple[int, str]:
        """For a command that must refuse to start: its exit code and output."""
        done = subprocess.run(
            self.argv, cwd=_REPO_ROOT, env=self.env, capture_output=True, timeout=timeout
        )
        return done.returncode, (done.stdout + done.stderr).decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, 10)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""
