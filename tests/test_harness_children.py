"""The harnesses' one way to end a child (fila/testing/children.py): a graceful stop
that kills what does not exit in time, and always waits, so no child outlives its test."""

from __future__ import annotations

import signal
import subprocess

from fila.testing.children import kill_child, stop_child


def _child(script: str) -> subprocess.Popen[bytes]:
    """A shell running `script`, returned once it printed `ready` (its traps are set)."""
    proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    return proc


def test_a_child_that_exits_on_sigterm_is_stopped_gracefully() -> None:
    proc = _child("trap 'exit 3' TERM; echo ready; while :; do sleep 0.05; done")
    assert stop_child(proc, timeout=10) is True
    assert proc.returncode == 3


def test_a_child_that_ignores_sigterm_is_killed_and_reported() -> None:
    proc = _child("trap '' TERM; echo ready; exec sleep 30")
    assert stop_child(proc, timeout=0.2) is False
    assert proc.returncode == -signal.SIGKILL


def test_a_child_that_already_exited_is_only_reaped() -> None:
    proc = _child("echo ready; exit 5")
    proc.wait()
    assert stop_child(proc, timeout=1) is True
    assert kill_child(proc) == 5


def test_kill_is_a_crash_not_a_stop() -> None:
    proc = _child("trap 'exit 3' TERM; echo ready; exec sleep 30")
    assert kill_child(proc) == -signal.SIGKILL
