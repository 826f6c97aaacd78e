"""`summary.json`: the schema of issue 11, written and read back.

Top level: `commit`, `timestamp`, `machine`, `placement`, `rows`. `machine` is an
object describing the host and the run (CPU, memory, kernel, the fsync latency the
run measured, load average before and after, each broker's version and settings,
the profile and command); each row is a `model.Row`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from competitive.model import Row

TOP_LEVEL = ("commit", "timestamp", "machine", "placement", "rows")


@dataclass(frozen=True, slots=True)
class Summary:
    commit: str
    timestamp: str
    machine: dict[str, Any]
    placement: str
    rows: list[Row] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "commit": self.commit,
            "timestamp": self.timestamp,
            "machine": self.machine,
            "placement": self.placement,
            "rows": [r.to_json() for r in self.rows],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Summary:
        missing = [k for k in TOP_LEVEL if k not in data]
        if missing:
            raise ValueError(f"summary without {', '.join(missing)}")
        return cls(
            commit=str(data["commit"]),
            timestamp=str(data["timestamp"]),
            machine=dict(data["machine"]),
            placement=str(data["placement"]),
            rows=[Row.from_json(r) for r in data["rows"]],
        )

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.failed]


def write(summary: Summary, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary.to_json(), indent=2) + "\n", encoding="utf-8")


def read(path: Path) -> Summary:
    return Summary.from_json(json.loads(path.read_text(encoding="utf-8")))
