"""Run-to-run spread of every figure over repeated runs of the same commit.

A regression gate is only as good as its thresholds: set below a figure's spread
it fails unchanged pull requests at random, set far above it misses real slowdowns.
`fila-bench spread` reads N results files of one commit and reports, per figure,
the median, the range, the largest deviation of one run from the median, and the
spread of what the gate actually compares: the median of `GATE_RUNS` runs (the
pull request's) against the median of `GATE_RUNS` others (the baseline's, taken
earlier, often hours earlier on another machine state). That is the number a
threshold must clear, and the suggestion is built on it.

Why not the single-run deviation: medians of three are steadier than single runs
within one session, but the baseline and the pull request are not measured in one
session. On these shared 2-core hosts the same commit's durable rates moved between
sessions an hour apart, in every run of the later one, and a threshold
set from one quiet session's single-run spread failed the first two unchanged
trials of a gate demonstration (docs/benchmarks.md, "Noise and the gate"). So the
study should pool runs from several sessions, and the gate-shaped spread over that
pool is computed exactly: among N sorted values, the highest median of `GATE_RUNS`
disjoint runs and the lowest one are the second-highest and second-lowest values
(for three), so the worst case needs no sampling.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from fila_bench.results import Report

MIN_THRESHOLD_PCT = 10.0  # the CI threshold: a noise floor never lowers it
MARGIN = 1.25  # suggested threshold = the gate-shaped spread plus a quarter
GATE_RUNS = 3  # CI compares medians of this many runs (scripts/bench-runs.sh)


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
    gate_dev_pct: float | None = None  # worst median-of-3 against median-of-3; see below

    @property
    def suggested_threshold_pct(self) -> float:
        """The gate-shaped spread (or, with fewer than two groups of runs, twice the
        largest single-run deviation: two medians can err in opposite directions) plus
        MARGIN, rounded up to 5%, and never below the CI threshold."""
        noise = self.gate_dev_pct if self.gate_dev_pct is not None else 2 * self.max_dev_pct
        return max(MIN_THRESHOLD_PCT, math.ceil(noise * MARGIN / 5) * 5)


def gate_dev_pct(values: Sequence[float], higher_is_better: bool) -> float | None:
    """The largest regression the gate could see between two disjoint groups of
    GATE_RUNS of `values` (the same commit): the best group's median as the baseline,
    the worst group's as the new figure, in percent of the baseline. None when the
    values do not make two disjoint groups."""
    if len(values) < 2 * GATE_RUNS:
        return None
    ordered = sorted(values)
    middle = GATE_RUNS // 2
    lowest, highest = ordered[middle], ordered[-1 - middle]
    base = highest if higher_is_better else lowest
    return (highest - lowest) / abs(base) * 100 if base else 0.0


def spread(reports: Sequence[Report]) -> list[Spread]:
    values: dict[str, list[float]] = {}
    first: dict[str, tuple[str, bool, bool]] = {}
    for report in reports:
        for result in report.results:
            values.setdefault(result.name, []).append(result.value)
            first.setdefault(result.name, (result.unit, result.gated, result.higher_is_better))
    out = []
    for name, vals in values.items():
        median = statistics.median(vals)
        mean = statistics.fmean(vals)
        dev = max(abs(v - median) for v in vals) / abs(median) * 100 if median else 0.0
        cv = statistics.pstdev(vals) / abs(mean) * 100 if mean else 0.0
        unit, gated, higher_is_better = first[name]
        out.append(
            Spread(
                name,
                unit,
                gated,
                len(vals),
                median,
                min(vals),
                max(vals),
                dev,
                cv,
                gate_dev_pct(vals, higher_is_better),
            )
        )
    return out


def spread_markdown(rows: Sequence[Spread], runs: int) -> str:
    lines = [
        f"Spread over {runs} run(s): median, range, largest deviation of one run from the "
        f"median, coefficient of variation, the worst gap between the medians of two "
        f"disjoint groups of {GATE_RUNS} runs (what the gate compares), and the threshold "
        "a gate on the figure would need.",
        "",
        "| figure | unit | gated | median | min | max | max dev | CV | gate gap | suggested |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap = "-" if r.gate_dev_pct is None else f"{r.gate_dev_pct:.1f}%"
        lines.append(
            f"| `{r.name}` | {r.unit} | {'yes' if r.gated else 'no'} | {r.median:.4g} | "
            f"{r.low:.4g} | {r.high:.4g} | {r.max_dev_pct:.1f}% | {r.cv_pct:.1f}% | "
            f"{gap} | {r.suggested_threshold_pct:g}% |"
        )
    return "\n".join(lines) + "\n"
