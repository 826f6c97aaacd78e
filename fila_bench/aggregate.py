"""Median of several runs: one noisy run should not pass or fail a pull request.

CI runs the suite three times and compares medians. Each benchmark's median is
taken over the runs that reported it; a benchmark missing from some runs (it failed
there) is kept with the runs it has, and the failures are carried into the output
so the aggregate cannot look cleaner than its inputs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from fila_bench.results import Report, Result, now_iso


def aggregate(reports: Sequence[Report]) -> Report:
    if not reports:
        raise ValueError("aggregate needs at least one run")
    by_name: dict[str, list[Result]] = {}
    for report in reports:
        for result in report.results:
            by_name.setdefault(result.name, []).append(result)
    medians = [
        Result(
            name=runs[0].name,
            value=statistics.median(r.value for r in runs),
            unit=runs[0].unit,
            higher_is_better=runs[0].higher_is_better,
            gated=runs[0].gated,
        )
        for runs in by_name.values()
    ]
    commits = {r.commit for r in reports}
    return Report(
        commit=commits.pop() if len(commits) == 1 else "mixed",
        timestamp=now_iso(),
        results=medians,
        failures=[f for r in reports for f in r.failures],
        extra={"runs": len(reports)},
    )
