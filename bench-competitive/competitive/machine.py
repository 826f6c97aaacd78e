"""What the figures were measured on: commit, host, disk, load, placement.

Durable throughput follows the disk's fsync latency and everything else the CPU, and
these machines are shared, so the run records the fsync latency it measured itself
and the load average before and after; a run whose machine was busy says so.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Final

BUSY_LOADAVG: Final = 0.5  # 1-minute load average above which the machine was shared
_FSYNC_PROBES: Final = 200


def commit(repo: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return 0.0


def fsync_ms(directory: Path | None = None) -> dict[str, float]:
    """p50 and p99 of appending 256 bytes and fsyncing, where brokers keep their data."""
    with tempfile.NamedTemporaryFile(dir=directory, prefix="fsync-probe-") as handle:
        times: list[float] = []
        for _ in range(_FSYNC_PROBES):
            os.write(handle.fileno(), b"j" * 256)
            began = time.perf_counter()
            os.fsync(handle.fileno())
            times.append((time.perf_counter() - began) * 1000)
    cuts = statistics.quantiles(times, n=100)
    return {"p50": round(cuts[49], 3), "p99": round(cuts[98], 3)}


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def describe(versions: dict[str, str]) -> dict[str, Any]:
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count() or 0,
        "memory_gib": _memory_gib(),
        "kernel": platform.release(),
        "os": _os_name(),
        "python": platform.python_version(),
        "fsync_ms": fsync_ms(Path(tempfile.gettempdir())),
        "versions": versions,
    }


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.system()
