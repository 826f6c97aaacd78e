"""Benchmark results and the JSON file they travel in.

The file is what CI stores, aggregates and compares, so each entry says which
direction is better (`higher_is_better`) instead of leaving `compare` to guess from
the unit, and whether a change in it should fail a build (`gated`). Derived numbers
that sit near zero (an overhead that is the difference of two noisy throughputs, a
fairness deviation far inside its hard limit) are reported but not gated: a relative
change of a number close to zero is noise, and those properties have their own
absolute checks inside the benchmark.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fila

MSG_S = "msg/s"
MS = "ms"
US = "us"
MIB = "MiB"
PP = "pp"
PCT = "%"
COUNT = "count"
RATIO = "ratio"  # a rate over another of the same run: echo_ceiling_50c, or buffered

# For files written before entries carried `higher_is_better`.
_HIGHER_IS_BETTER_BY_UNIT = {MSG_S: True, "MB/s": True}

_REPO_ROOT = Path(fila.__file__).resolve().parent.parent


class ResultsFileError(ValueError):
    """A results file that is missing, not JSON, or not in the expected shape."""


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    value: float
    unit: str
    higher_is_better: bool
    gated: bool = True

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": round(self.value, 4),
            "unit": self.unit,
            "higher_is_better": self.higher_is_better,
            "gated": self.gated,
        }

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> Result:
        try:
            unit = str(entry["unit"])
            return cls(
                name=str(entry["name"]),
                value=float(entry["value"]),
                unit=unit,
                higher_is_better=bool(
                    entry.get("higher_is_better", _HIGHER_IS_BETTER_BY_UNIT.get(unit, False))
                ),
                gated=bool(entry.get("gated", True)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ResultsFileError(f"bad benchmark entry {entry!r}: {exc}") from None


def throughput(name: str, msg_per_s: float, *, latency_bound: bool = False) -> Result:
    """A closed-loop rate. `latency_bound`: one call in flight in all, so the rate is
    one over a round trip, which follows how quickly a busy host schedules the two
    processes, not how much work the broker does; such rates (and their ratios) are
    reported but not gated (docs/benchmarks.md, "Noise and the gate")."""
    return Result(name, msg_per_s, MSG_S, higher_is_better=True, gated=not latency_bound)


def cpu_per_job(name: str, cpu_s: float, jobs: int, *, gated: bool = True) -> Result:
    """The broker process's CPU time (all threads) over a phase, per job it moved, in
    microseconds (`fila_bench.server.cpu_seconds`: clock ticks, so for phases of a
    second or more)."""
    return Result(name, 1e6 * cpu_s / jobs if jobs else 0.0, US, False, gated)


def over_ceiling(name: str, rate: float, ceiling: float, *, gated: bool = True) -> Result:
    """A rate over the matching echo ceiling measured in the same case."""
    return Result(name, rate / ceiling if ceiling else 0.0, RATIO, True, gated)


def latency_ms(name: str, ms: float, *, gated: bool = True) -> Result:
    return Result(name, ms, MS, higher_is_better=False, gated=gated)


@dataclass(frozen=True, slots=True)
class Failure:
    """A benchmark whose check failed or that could not run; the run exits non-zero."""

    benchmark: str
    error: str


@dataclass(slots=True)
class Report:
    commit: str
    timestamp: str
    results: list[Result] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "commit": self.commit,
            "timestamp": self.timestamp,
            "benchmarks": [r.to_json() for r in self.results],
        }
        if self.failures:
            doc["failures"] = [{"benchmark": f.benchmark, "error": f.error} for f in self.failures]
        doc.update(self.extra)
        return doc

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")


def load_report(path: Path) -> Report:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultsFileError(f"{path}: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("benchmarks"), list):
        raise ResultsFileError(f'{path}: expected an object with a "benchmarks" list')
    failures = [
        Failure(str(f.get("benchmark", "?")), str(f.get("error", "")))
        for f in doc.get("failures", [])
        if isinstance(f, dict)
    ]
    return Report(
        commit=str(doc.get("commit", "unknown")),
        timestamp=str(doc.get("timestamp", "")),
        results=[Result.from_json(e) for e in doc["benchmarks"]],
        failures=failures,
    )


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def git_commit() -> str:
    """HEAD of the checkout the broker runs from, so a result names the code it measured."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=_REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def environment() -> dict[str, Any]:
    """Where the numbers came from; durable throughput in particular tracks the disk, and
    everything tracks how busy the host was (the load generator shares it with the broker).
    """
    return {
        "cpus": os.cpu_count(),
        "loadavg_1m_start": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
