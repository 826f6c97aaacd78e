"""Child processes of the harnesses: a free port to give them, and one way to end them.

Ending a child always waits for it, so no harness leaves a zombie or a process still
holding its port and data directory behind.
"""

from __future__ import annotations

import signal
import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def kill_child(proc: subprocess.Popen[bytes]) -> int:
    """SIGKILL (a crash) unless it has exited already, and wait; returns the exit code."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    return proc.returncode


def stop_child(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """SIGTERM (a graceful stop) and wait up to `timeout` seconds; a child still running
    then is killed (`kill_child`). True if it exited by itself (or had already exited),
    False if it had to be killed, which the caller decides whether to report."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_child(proc)
        return False
    return True
