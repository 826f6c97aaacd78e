"""Brokers under test: one fresh child process per benchmark, and what we read from it.

A fresh process and data directory per benchmark keeps benchmarks independent: no
backlog, tombstones, warmed caches or leaked consumers carry over from the previous
one. Reading RSS from /proc and RocksDB's own LOG needs only the pid and the data
directory, so the broker is measured without any hook inside it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import tempfile
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fila.config import PersistMode
from fila.testing.children import free_port
from fila.testing.server import ServerProcess
from fila_bench.case import Context
from fila_bench.cpus import pin_process
from fila_bench.load import background


@asynccontextmanager
async def broker(
    ctx: Context, name: str, persist_mode: PersistMode, config_toml: str | None = None
) -> AsyncIterator[ServerProcess]:
    """A started broker in its own directory under the run's workdir, stopped (SIGTERM)
    on exit, and pinned to the server CPUs when the run pins (`fila_bench.cpus`).

    Start and stop block on subprocess and health polling, so they run in a thread
    and the event loop (and the progress display) stays live. The data directory is
    removed after the stop (the compaction burst alone writes hundreds of MiB); the
    broker's log and config stay beside it.
    """
    root = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=ctx.workdir))
    scrape_s = ctx.profile.telemetry_scrape_s
    metrics_port = free_port() if scrape_s is not None else None
    if metrics_port is not None:
        config_toml = _with_prometheus(config_toml, metrics_port)
    server = ServerProcess(root / "data", config_toml=config_toml, persist_mode=persist_mode)
    await asyncio.to_thread(server.start)
    try:
        if ctx.placement is not None:
            # Once serving: RocksDB's and gRPC's threads exist and are pinned with it.
            pin_process(server.pid, ctx.placement.server)
        if metrics_port is None or scrape_s is None:
            yield server
        else:
            async with background(_scrape(metrics_port, scrape_s)):
                yield server
    finally:
        if server.running:
            await asyncio.to_thread(server.stop)
        await asyncio.to_thread(shutil.rmtree, server.data_dir, True)


def _with_prometheus(config_toml: str | None, port: int) -> str:
    """The case's config plus a Prometheus endpoint (no case configures telemetry)."""
    config_toml = config_toml or ""
    if "[telemetry]" in config_toml:
        raise ValueError(
            "a case's config already has [telemetry]; --telemetry-scrape cannot add it"
        )
    return f'{config_toml}\n[telemetry]\nprometheus_listen = "127.0.0.1:{port}"\n'


async def _scrape(port: int, every_s: float) -> None:
    """Reads /metrics every `every_s` seconds, as a Prometheus server would, so each
    case pays for its collections. Until the endpoint first answers a failure is
    retried; after that it fails the case (the scraping is cancelled before the
    broker stops), so a run cannot claim telemetry was on when nothing was read."""
    url = f"http://127.0.0.1:{port}/metrics"

    def fetch() -> None:
        with urllib.request.urlopen(url, timeout=10) as response:
            response.read()

    answered = False
    while True:
        try:
            await asyncio.to_thread(fetch)
            answered = True
        except OSError:
            if answered:
                raise
        await asyncio.sleep(every_s)


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB, from /proc/<pid>/status (Linux only)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # the kernel's "kB" is KiB
    raise OSError(f"no VmRSS line for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads, finished ones included) `pid` has used, from
    /proc/<pid>/stat. The kernel counts it in clock ticks (10 ms on most hosts), so it
    is for windows of a second or more, not for single calls."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the parenthesised command name, which may itself contain spaces.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


class RssPeak:
    """Samples a process's RSS every `interval_s` while running, keeping the maximum."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self._pid = pid
        self._interval_s = interval_s
        self.peak_mib = 0.0

    async def run(self) -> None:
        while True:
            self.peak_mib = max(self.peak_mib, rss_mib(self._pid))
            await asyncio.sleep(self._interval_s)


_EVENT = re.compile(
    r'"event": "(flush_started|compaction_started|compaction_finished|trivial_move)"'
)


def rocksdb_events(server: ServerProcess) -> dict[str, int] | None:
    """Counts of flush and compaction events in the broker's RocksDB LOG, or None.

    The LOG sits in `<data_dir>/db` (where `fila.storage.backend.RocksStorage` puts
    the database); if a future layout moves it, the compaction benchmark still runs
    and just cannot prove a compaction happened.
    """
    return rocksdb_log_events(server.data_dir / "db" / "LOG")


def rocksdb_log_events(log: Path) -> dict[str, int] | None:
    """Counts of flush and compaction events in a RocksDB LOG file, or None if unreadable.

    A trivial move is a compaction that moves tables to a lower level without
    rewriting them, logged as its own event instead of a started and finished pair.
    """
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    counts = dict.fromkeys(
        ("flush_started", "compaction_started", "compaction_finished", "trivial_move"), 0
    )
    for match in _EVENT.finditer(text):
        counts[match.group(1)] += 1
    return counts
