"""Base versus new: the delta of every benchmark and whether it regressed.

Direction comes from each entry's `higher_is_better` (the new run's, else the
base's), so msg/s regresses when it drops and ms, us and MiB when they grow. Only
`gated` entries can fail the comparison; a benchmark that exists on one side only is
shown but never fails it, so adding or renaming a benchmark does not break CI.

Each figure is held to the larger of the threshold asked for (10% in CI) and its own
noise threshold from `thresholds.toml`: a gate tighter than the run-to-run spread
of a figure on the machine that runs it fails pull requests at random, so the spread
study (`scripts/bench-spread.sh`) sets a floor under every figure it measured.
"""

from __future__ import annotations

import importlib.resources
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from fila_bench.results import Report, Result


class Verdict(Enum):
    OK = "ok"
    IMPROVED = "improved"
    REGRESSED = "REGRESSED"
    INFO = "info"  # not gated, shown only
    NEW = "new"
    MISSING = "missing"


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    unit: str
    base: float | None
    new: float | None
    delta_pct: float | None  # (new - base) / base, signed, None when undefined
    higher_is_better: bool
    verdict: Verdict
    threshold_pct: float  # what this figure was held to
    gated: bool


class ThresholdsError(ValueError):
    """A thresholds file that cannot be read or has a non-numeric entry."""


def load_thresholds(path: Path | None = None) -> dict[str, float]:
    """Per-figure noise thresholds in percent: `path`, or the packaged thresholds.toml."""
    try:
        if path is None:
            text = importlib.resources.files("fila_bench").joinpath("thresholds.toml").read_text()
        else:
            text = path.read_text(encoding="utf-8")
        table = tomllib.loads(text).get("thresholds", {})
        return {str(name): float(value) for name, value in table.items()}
    except (OSError, tomllib.TOMLDecodeError, TypeError, ValueError) as exc:
        raise ThresholdsError(f"{path or 'thresholds.toml'}: {exc}") from None


def compare(
    base: Report,
    new: Report,
    threshold_pct: float,
    thresholds: Mapping[str, float] | None = None,
) -> list[Row]:
    floors = thresholds or {}
    base_by_name = {r.name: r for r in base.results}
    new_by_name = {r.name: r for r in new.results}
    names = list(base_by_name) + [n for n in new_by_name if n not in base_by_name]
    return [
        _row(n, base_by_name.get(n), new_by_name.get(n), max(threshold_pct, floors.get(n, 0.0)))
        for n in names
    ]


def regressions(rows: list[Row]) -> list[Row]:
    return [row for row in rows if row.verdict is Verdict.REGRESSED]


def _row(name: str, base: Result | None, new: Result | None, threshold_pct: float) -> Row:
    ref = new or base
    assert ref is not None  # every name comes from one of the two reports
    base_value = base.value if base else None
    new_value = new.value if new else None
    delta = None
    if base_value is not None and new_value is not None and base_value != 0:
        delta = (new_value - base_value) / abs(base_value) * 100
    return Row(
        name,
        ref.unit,
        base_value,
        new_value,
        delta,
        ref.higher_is_better,
        _verdict(base, new, delta, threshold_pct),
        threshold_pct,
        bool(base and new and base.gated and new.gated),
    )


def _verdict(
    base: Result | None, new: Result | None, delta: float | None, threshold_pct: float
) -> Verdict:
    if base is None:
        return Verdict.NEW
    if new is None:
        return Verdict.MISSING
    if not (base.gated and new.gated) or delta is None:
        return Verdict.INFO
    worse_by = -delta if new.higher_is_better else delta
    if worse_by > threshold_pct:
        return Verdict.REGRESSED
    if -worse_by > threshold_pct:
        return Verdict.IMPROVED
    return Verdict.OK
