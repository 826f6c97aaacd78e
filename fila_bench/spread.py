"""Run-to-run spread of every figure over repeated runs of the same commit.

A regression gate is only as good as its thresholds: set below a figure's spread
it fails unchanged pull requests at random, set far above it misses real slowdowns.
`fila-bench spread` reads N results files of one commit and reports, per figure,
the median, the range and the largest deviation of one run from the median, and
suggests a threshold above that (for `thresholds.toml`). CI compares medians of
three runs, whose spread is smaller than that of single runs, so a threshold above
the single-run spread has margin built in.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from fila_bench.results import Report

MIN_THRESHOLD_PCT = 10.0  # the CI threshold: a noise floor never lowers it
MARGIN = 1.25  # suggested threshold = the largest single-run deviation plus a quarter


@dataclass(frozen=True, slots=True)
class Spread:
    name: str
    unit: str
    gated: bool
    runs: int
    median: float
    low: float
    high: float
    max_dev_pct: float  # largest |run - median| / |median|, in percent
    cv_pct: float  # standard deviation / mean, in percent

    @property
    def suggested_threshold_pct(self) -> float:
        """The largest single-run deviation plus MARGIN, rounded up to 5%, at least 10%."""
        return max(MIN_THRESHOLD_PCT, math.ceil(self.max_dev_pct * MARGIN / 5) * 5)


def spread(reports: Sequence[Report]) -> list[Spread]:
    values: dict[str, list[float]] = {}
    first: dict[str, tuple[str, bool]] = {}
    for report in reports:
        for result in report.results:
            values.setdefault(result.name, []).append(result.value)
            first.setdefault(result.name, (result.unit, result.gated))
    out = []
    for name, vals in values.items():
        median = statistics.median(vals)
        mean = statistics.fmean(vals)
        dev = max(abs(v - median) for v in vals) / abs(median) * 100 if median else 0.0
        cv = statistics.pstdev(vals) / abs(mean) * 100 if mean else 0.0
        unit, gated = first[name]
        out.append(Spread(name, unit, gated, len(vals), median, min(vals), max(vals), dev, cv))
    return out


def spread_markdown(rows: Sequence[Spread], runs: int) -> str:
    lines = [
        f"Spread over {runs} run(s): median, range, largest deviation of one run from the "
        "median, coefficient of variation, and the threshold a gate on the figure would need.",
        "",
        "| figure | unit | gated | median | min | max | max dev | CV | suggested |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        suggested = f"{r.suggested_threshold_pct:g}%"
        lines.append(
            f"| `{r.name}` | {r.unit} | {'yes' if r.gated else 'no'} | {r.median:.4g} | "
            f"{r.low:.4g} | {r.high:.4g} | {r.max_dev_pct:.1f}% | {r.cv_pct:.1f}% | "
            f"{suggested} |"
        )
    return "\n".join(lines) + "\n"
