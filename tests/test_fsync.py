"""Sync mode fsyncs before it answers: proven at the system-call level.

The broker runs under `strace -f -ttt -T`, recording the WAL's writes, every
fsync/fdatasync and every `sendmsg` to a socket. Each state-changing RPC is sent
alone; in the client's window around it, the response is the first `sendmsg`
carrying an HTTP/2 HEADERS or DATA frame, and a sync of the WAL file must have
*completed* before that `sendmsg` started. Remove the sync (for example make
`RocksStorage.sync` do nothing) and every case here fails.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import ServerFactory, wait_until
from support.stubs import RPC_TIMEOUT_S, Fila, connect

from fila.v1 import admin_pb2, service_pb2

PROMPT_S = 10.0

pytestmark = pytest.mark.skipif(
    shutil.which("strace") is None and not os.environ.get("CI"),
    reason="strace is not installed (.ci/run installs it)",
)

_LINE = re.compile(r"^(?P<pid>\d+)\s+(?P<ts>\d+\.\d+)\s+(?P<rest>.*)$")
_CALL = re.compile(r"^(?P<name>\w+)\((?P<fd>\d+)")
_DURATION = re.compile(r"<(?P<dur>\d+\.\d+)>\s*$")
_RESUMED = re.compile(r"^<\.\.\. (?P<name>\w+) resumed>")


@dataclass(frozen=True, slots=True)
class Syscall:
    pid: int
    name: str
    fd: int
    start: float
    end: float
    text: str


def _parse(trace: str) -> list[Syscall]:
    """System calls with start and end times, joining `unfinished`/`resumed` halves."""
    calls: list[Syscall] = []
    pending: dict[tuple[int, str], tuple[int, float, str]] = {}
    for line in trace.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        pid, ts, rest = int(match["pid"]), float(match["ts"]), match["rest"]
        resumed = _RESUMED.match(rest)
        if resumed is not None:
            opened = pending.pop((pid, resumed["name"]), None)
            duration = _DURATION.search(rest)
            if opened is not None and duration is not None:
                fd, start, text = opened
                calls.append(
                    Syscall(pid, resumed["name"], fd, start, start + float(duration["dur"]), text)
                )
            continue
        call = _CALL.match(rest)
        if call is None:
            continue
        if rest.endswith("<unfinished ...>"):
            pending[(pid, call["name"])] = (int(call["fd"]), ts, rest)
            continue
        duration = _DURATION.search(rest)
        end = ts + float(duration["dur"]) if duration else ts
        calls.append(Syscall(pid, call["name"], int(call["fd"]), ts, end, rest))
    return sorted(calls, key=lambda c: c.start)


def _is_response(call: Syscall) -> bool:
    """A sendmsg whose first HTTP/2 frame is HEADERS (1) or DATA (0)."""
    match = re.search(r'iov_base="((?:\\.|[^"\\]){0,40})', call.text)
    if match is None:
        return False
    raw = match[1].encode().decode("unicode_escape").encode("latin-1")
    return len(raw) >= 4 and raw[3] in (0, 1)


def _check_synced_before_answer(
    calls: list[Syscall], window: tuple[float, float], rpc: str, wal_fds: set[int]
) -> None:
    begin, end = window
    inside = [c for c in calls if begin <= c.start <= end]
    responses = [c for c in inside if c.name == "sendmsg" and _is_response(c)]
    assert responses, f"{rpc}: no response sendmsg traced in the call's window"
    answer = responses[0]
    writes = [
        c for c in inside if c.name in ("write", "writev", "pwrite64") and c.start < answer.start
    ]
    wal_writes = [c for c in writes if c.fd in wal_fds]
    assert wal_writes, f"{rpc}: no WAL write traced before the answer"
    last = wal_writes[-1]
    syncs = [
        c
        for c in inside
        if c.name in ("fsync", "fdatasync")
        and c.fd == last.fd
        and c.start >= last.start
        and c.end <= answer.start
    ]
    assert syncs, (
        f"{rpc}: the answer left at {answer.start:.6f} with no fsync of the WAL (fd {last.fd}) "
        f"completed after its last write ({last.start:.6f})"
    )


def _broker_pid(strace_pid: int) -> int:
    children = subprocess.run(
        ["pgrep", "-P", str(strace_pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert len(children) == 1, f"strace {strace_pid} has children {children}"
    return int(children[0])


def _wal_fds(pid: int, db_dir: Path) -> set[int]:
    """The broker's open descriptors on RocksDB WAL files (db/*.log)."""
    fds: set[int] = set()
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith(str(db_dir)) and target.endswith(".log"):
            fds.add(int(entry.name))
    return fds


def _stop_traced(strace_pid: int) -> None:
    """strace blocks fatal signals: end the broker itself and let strace follow."""
    os.kill(_broker_pid(strace_pid), signal.SIGTERM)
    deadline = time.monotonic() + PROMPT_S
    while time.monotonic() < deadline:
        try:
            os.kill(strace_pid, 0)
        except ProcessLookupError:
            return
        if os.waitpid(strace_pid, os.WNOHANG) != (0, 0):
            return
        time.sleep(0.05)  # pacing a bounded poll for the process to exit


def _operations(fila: Fila) -> list[tuple[str, Callable[[], object]]]:
    """Each state-changing RPC of the API, set up so it succeeds when run in order."""
    svc, admin = fila.svc, fila.admin
    state: dict[str, str] = {}

    def consume_one() -> str:
        with fila.consume("t", prefetch=1) as stream:
            return stream.get(PROMPT_S).id

    def enqueue() -> None:
        state["ack"] = fila.enqueue("t", b"to ack")

    def ack() -> None:
        svc.Ack(
            service_pb2.AckRequest(queue="t", message_id=state["leased"]), timeout=RPC_TIMEOUT_S
        )

    return [
        ("CreateQueue", lambda: fila.create_queue("t", on_failure=_DLQ)),
        ("Enqueue", enqueue),
        (
            "EnqueueBatch",
            lambda: svc.EnqueueBatch(
                service_pb2.EnqueueBatchRequest(
                    messages=[service_pb2.EnqueueRequest(queue="t", payload=b"b")] * 3
                ),
                timeout=RPC_TIMEOUT_S,
            ),
        ),
        (
            "StreamEnqueue",
            lambda: list(
                svc.StreamEnqueue(
                    iter(
                        [
                            service_pb2.StreamEnqueueRequest(
                                sequence_number=1,
                                messages=[service_pb2.EnqueueRequest(queue="t", payload=b"s")],
                            )
                        ]
                    ),
                    timeout=RPC_TIMEOUT_S,
                )
            ),
        ),
        ("lease", lambda: state.update(leased=consume_one())),
        (
            "ExtendLease",
            lambda: svc.ExtendLease(
                service_pb2.ExtendLeaseRequest(
                    queue="t", message_id=state["leased"], extend_ms=60_000
                ),
                timeout=RPC_TIMEOUT_S,
            ),
        ),
        ("Ack", ack),
        ("lease", lambda: state.update(leased=consume_one())),
        (
            "Nack",
            lambda: svc.Nack(
                service_pb2.NackRequest(queue="t", message_id=state["leased"], error="x"),
                timeout=RPC_TIMEOUT_S,
            ),
        ),
        ("lease", lambda: state.update(leased=consume_one())),
        (
            "AckBatch",
            lambda: svc.AckBatch(
                service_pb2.AckBatchRequest(
                    acks=[service_pb2.AckRequest(queue="t", message_id=state["leased"])]
                ),
                timeout=RPC_TIMEOUT_S,
            ),
        ),
        ("lease", lambda: state.update(leased=consume_one())),
        (
            "NackBatch",
            lambda: svc.NackBatch(
                service_pb2.NackBatchRequest(
                    nacks=[service_pb2.NackRequest(queue="t", message_id=state["leased"])]
                ),
                timeout=RPC_TIMEOUT_S,
            ),
        ),
        (
            "Redrive",
            lambda: admin.Redrive(
                admin_pb2.RedriveRequest(dlq_queue="t.dlq"), timeout=RPC_TIMEOUT_S
            ),
        ),
        (
            "SetConfig",
            lambda: admin.SetConfig(
                admin_pb2.SetConfigRequest(key="throttle.k", value="5,5"), timeout=RPC_TIMEOUT_S
            ),
        ),
        (
            "PurgeQueue",
            lambda: admin.PurgeQueue(admin_pb2.PurgeQueueRequest(queue="t"), timeout=RPC_TIMEOUT_S),
        ),
        ("DeleteQueue", lambda: fila.delete_queue("t")),
    ]


_DLQ = 'function on_failure(m) return { action = "dlq" } end'


def test_every_state_changing_rpc_is_fsynced_before_its_answer(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    trace_path = tmp_path / "strace.txt"
    strace = [
        "strace", "-f", "-ttt", "-T", "-s", "40", "-o", str(trace_path),
        "-e", "trace=fsync,fdatasync,sendmsg,write,writev,pwrite64",
    ]  # fmt: skip
    server = server_factory(persist_mode="sync", wrapper=strace, timeout=60.0)
    windows: list[tuple[str, tuple[float, float]]] = []
    wal_fds: set[int] = set()
    try:
        with connect(server.addr) as fila:
            for name, operation in _operations(fila):
                begin = time.time()
                operation()
                if name != "lease":
                    windows.append((name, (begin, time.time())))
        wal_fds = _wal_fds(_broker_pid(server.pid), server.data_dir / "db")
    finally:
        _stop_traced(server.pid)
        wait_until(lambda: not server.running, PROMPT_S, what="traced broker exited")
    assert wal_fds, "found no open WAL file in the broker"
    calls = _parse(trace_path.read_text(errors="replace"))
    for name, window in windows:
        _check_synced_before_answer(calls, window, name, wal_fds)
    assert {name for name, _ in windows} >= {
        "CreateQueue", "Enqueue", "EnqueueBatch", "StreamEnqueue", "ExtendLease", "Ack",
        "Nack", "AckBatch", "NackBatch", "Redrive", "SetConfig", "PurgeQueue", "DeleteQueue",
    }  # fmt: skip
