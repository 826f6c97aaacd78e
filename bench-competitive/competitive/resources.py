"""CPU seconds and peak resident memory of a broker, read from /proc.

A broker is every process of its session plus those carrying its instance marker
(see `procs`), so RabbitMQ's `beam.smp`, its `erl_child_setup` and its `epmd` all
count, as do any helper processes of the others. CPU is `utime + stime` from /proc/<pid>/stat (clock
ticks); memory is the sum of `VmRSS` over the processes, sampled every 100 ms, and
its peak over a window. Sampling is cheap (a few small reads) and runs in the load
generator's process, whose CPU it slightly adds to.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from competitive.procs import members

_TICKS_PER_S: Final = os.sysconf("SC_CLK_TCK")
_REFRESH_PIDS_EVERY: Final = 10  # samples between re-scans of /proc for new processes


@dataclass(frozen=True, slots=True)
class Usage:
    cpu_seconds: float
    peak_rss_mib: float


def read_cpu_ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks."""
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may contain spaces; fields after it are fixed.
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)


def read_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0  # a zombie has no VmRSS line


@dataclass(slots=True)
class TreeSampler:
    """Keeps per-process CPU and the peak of summed RSS for one broker instance."""

    instance: str
    sid: int  # the broker's session (its main pid)
    interval_s: float = 0.1
    _pids: set[int] = field(default_factory=set)
    _ticks: dict[int, int] = field(default_factory=dict)
    _window_ticks: int = 0
    _peak_kib: int = 0
    _samples: int = 0

    def sample(self) -> None:
        if self._samples % _REFRESH_PIDS_EVERY == 0:
            self._pids = members(self.instance, self.sid)
        self._samples += 1
        rss = 0
        for pid in list(self._pids):
            try:
                self._ticks[pid] = read_cpu_ticks(pid)
                rss += read_rss_kib(pid)
            except (OSError, ValueError, IndexError):
                self._pids.discard(pid)  # exited; its last CPU reading is kept
        self._peak_kib = max(self._peak_kib, rss)

    def begin_window(self) -> None:
        self._samples = 0  # forces a re-scan of the process tree
        self.sample()
        self._window_ticks = sum(self._ticks.values())
        self._peak_kib = 0
        self.sample()

    def end_window(self) -> Usage:
        self.sample()
        ticks = sum(self._ticks.values()) - self._window_ticks
        return Usage(ticks / _TICKS_PER_S, self._peak_kib / 1024)

    async def run(self) -> None:
        """Samples until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)
