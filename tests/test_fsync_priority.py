"""The WAL fsync thread's raised priority (fila.storage.thread_priority), on a real broker.

Read from /proc, as an operator would check it: after a durable enqueue the broker has
exactly one thread `storage.fsync_priority_boost` nice levels above the others, and
none with the boost at 0. Without the privilege to raise it the broker syncs as
before and logs why once; that case runs in a process without CAP_SYS_NICE.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from support import ServerFactory

from fila_sdk import Client

PR_CAPBSET_DROP, CAP_SYS_NICE = 24, 23  # <linux/prctl.h>, <linux/capability.h>


def _nice(stat_path: Path) -> int:
    stat = stat_path.read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[16])  # field 19 of proc_pid_stat(5)


def _raised_threads(pid: int) -> list[int]:
    """How many levels above the main thread each thread of process `pid` runs, where it does."""
    main = _nice(Path(f"/proc/{pid}/stat"))
    raised = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            nice = _nice(task / "stat")
        except FileNotFoundError:  # a thread that ended while listed
            continue
        if nice < main:
            raised.append(main - nice)
    return raised


needs_privilege = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.geteuid() != 0,
    reason="raising a thread's priority needs root (CAP_SYS_NICE) here",
)


def _enqueue_durably(addr: str) -> None:
    queue = f"prio-{uuid.uuid4().hex[:8]}"
    with Client(addr) as client:
        client.create_queue(queue)
        client.enqueue(queue, {}, b"x")  # answered after the fsync thread's first sync


@needs_privilege
def test_the_fsync_thread_runs_the_configured_levels_above_the_other_threads(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(config_toml="[storage]\nfsync_priority_boost = 7\n")
    _enqueue_durably(server.addr)
    assert _raised_threads(server.pid) == [7]


@needs_privilege
def test_the_default_boost_is_15_levels(server_factory: ServerFactory) -> None:
    server = server_factory()
    _enqueue_durably(server.addr)
    assert _raised_threads(server.pid) == [15]


def test_a_boost_of_0_leaves_every_thread_at_the_brokers_priority(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(config_toml="[storage]\nfsync_priority_boost = 0\n")
    _enqueue_durably(server.addr)
    assert _raised_threads(server.pid) == []


UNPRIVILEGED_SYNC = textwrap.dedent(
    """
    import asyncio, logging, os, threading
    from fila.storage.backend import MemoryStorage
    from fila.storage.committer import Committer

    logging.basicConfig(level=logging.INFO, format="%(message)s %(reason)s")
    seen = []

    class Storage(MemoryStorage):
        def sync(self):
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            super().sync()

    async def main():
        committer = Committer(Storage(), "sync", print, fsync_priority_boost=5)
        committer.put(b"k", b"v")
        await asyncio.wait_for(committer.flushed(), 10)
        committer.close()

    asyncio.run(main())
    print("synced at nice", seen[0], "from", os.getpriority(os.PRIO_PROCESS, 0))
    """
)


def _sync_without_cap_sys_nice() -> subprocess.CompletedProcess[str]:
    """Runs UNPRIVILEGED_SYNC in a process without CAP_SYS_NICE.

    Root keeps CAP_SYS_NICE across exec only if its bounding set still holds it, so a
    first Python drops it from the bounding set and execs the one that runs the sync.
    That step is a process of its own, not a `preexec_fn`: forking a process whose
    other threads (gRPC's, another test's) may hold a lock, then calling into the C
    library before exec, can deadlock the child, and did hang this test when it ran
    beside other files.

    (The other way to allow it, RLIMIT_NICE as systemd's LimitNICE= sets it, is not
    tested: raising that limit needs CAP_SYS_RESOURCE, which root lacks on our CI machines.)"""
    drop_then_exec = textwrap.dedent(
        f"""
        import ctypes, os, sys
        if os.geteuid() == 0 and ctypes.CDLL(None).prctl({PR_CAPBSET_DROP}, {CAP_SYS_NICE}):
            sys.exit("could not drop CAP_SYS_NICE")
        os.execv(sys.executable, [sys.executable, "-c", sys.argv[1]])
        """
    )
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-c", drop_then_exec, UNPRIVILEGED_SYNC],
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(repo)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux-only")
def test_without_the_privilege_the_committer_syncs_at_its_own_priority_and_says_why() -> None:
    done = _sync_without_cap_sys_nice()
    assert "the WAL fsync thread runs at the broker's own priority" in done.stderr
    assert "needs CAP_SYS_NICE or a nice limit" in done.stderr
    assert "synced at nice 0 from 0" in done.stdout
