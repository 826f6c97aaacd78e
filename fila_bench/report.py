"""Rich tables for people; the JSON in `results.py` is for machines; Markdown for the
pull-request comment CI posts.

Numbers are formatted by unit (throughput as whole messages, latencies with three
decimals) so a column of results reads at a glance, and the arrow says which way is
better without the reader having to know the benchmark.
"""

from __future__ import annotations

from collections.abc import Iterable

from rich.console import Console, JustifyMethod
from rich.panel import Panel
from rich.table import Table

from fila_bench.compare import Row, Verdict
from fila_bench.results import MSG_S, Failure, Report

_VERDICT_STYLE = {
    Verdict.OK: "green",
    Verdict.IMPROVED: "bold green",
    Verdict.REGRESSED: "bold red",
    Verdict.INFO: "dim",
    Verdict.NEW: "cyan",
    Verdict.MISSING: "yellow",
}


def fmt_value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == MSG_S:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:,.1f}"
    return f"{value:,.3f}"


def _name_width(names: Iterable[str]) -> int:
    """Names are what a reader searches for; narrow terminals (CI logs are 80 columns)
    should squeeze the other columns rather than cut a name."""
    return max((len(n) for n in names), default=10)


def _arrow(higher_is_better: bool) -> str:
    return "↑" if higher_is_better else "↓"


def results_table(report: Report, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("benchmark", min_width=_name_width(r.name for r in report.results))
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_column("better", justify="center")
    table.add_column("gated", justify="center")
    for r in report.results:
        table.add_row(
            r.name,
            fmt_value(r.value, r.unit),
            r.unit,
            _arrow(r.higher_is_better),
            "yes" if r.gated else "no",
        )
    return table


def compare_table(rows: list[Row], threshold_pct: float) -> Table:
    table = Table(title=f"fila-bench compare (threshold {threshold_pct:g}%)", title_justify="left")
    table.add_column("benchmark", min_width=_name_width(row.name for row in rows))
    columns: list[tuple[str, JustifyMethod]] = [
        ("unit", "left"),
        ("base", "right"),
        ("new", "right"),
        ("delta", "right"),
        ("limit", "right"),
        ("better", "center"),
        ("verdict", "left"),
    ]
    for column, justify in columns:
        table.add_column(column, justify=justify)
    for row in rows:
        delta = "-" if row.delta_pct is None else f"{row.delta_pct:+.1f}%"
        style = _VERDICT_STYLE[row.verdict]
        table.add_row(
            row.name,
            row.unit,
            fmt_value(row.base, row.unit),
            fmt_value(row.new, row.unit),
            delta,
            f"{row.threshold_pct:g}%" if row.gated else "-",
            _arrow(row.higher_is_better),
            f"[{style}]{row.verdict.value}[/]",
        )
    return table


def compare_markdown(
    rows: list[Row],
    threshold_pct: float,
    failures: list[Failure],
    base_commit: str,
    new_commit: str,
) -> str:
    """The comparison as GitHub Markdown: verdict first, gated figures in a table, the
    informational ones folded away so the comment stays short."""
    worse = [r for r in rows if r.verdict is Verdict.REGRESSED]
    if failures:
        headline = f"**{len(failures)} benchmark(s) failed their own checks.**"
    elif worse:
        headline = f"**{len(worse)} regression(s):** " + ", ".join(f"`{r.name}`" for r in worse)
    else:
        headline = "No regression past the thresholds."
    lines = [
        f"### fila-bench: {'FAIL' if failures or worse else 'pass'}",
        "",
        headline,
        "",
        f"Base `{base_commit[:12]}`, new `{new_commit[:12]}`; each gated figure is held to "
        f"{threshold_pct:g}% or its measured noise threshold, whichever is larger.",
        "",
    ]
    if failures:
        lines += [f"- `{f.benchmark}`: {' '.join(f.error.split())}" for f in failures]
        lines.append("")
    gated = [r for r in rows if r.gated]
    info = [r for r in rows if not r.gated]
    lines += _md_table(gated, with_limit=True)
    if info:
        lines += [
            "",
            f"<details><summary>{len(info)} informational figure(s), not gated</summary>",
            "",
            *_md_table(info, with_limit=False),
            "",
            "</details>",
        ]
    return "\n".join(lines) + "\n"


def _md_table(rows: list[Row], *, with_limit: bool) -> list[str]:
    head = ["benchmark", "unit", "base", "new", "delta", *(["limit"] if with_limit else [])]
    head.append("verdict")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        delta = "-" if row.delta_pct is None else f"{row.delta_pct:+.1f}%"
        cells = [
            f"`{row.name}` {_arrow(row.higher_is_better)}",
            row.unit,
            fmt_value(row.base, row.unit),
            fmt_value(row.new, row.unit),
            delta,
            *([f"{row.threshold_pct:g}%"] if with_limit else []),
            f"**{row.verdict.value}**" if row.verdict is Verdict.REGRESSED else row.verdict.value,
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def print_failures(console: Console, failures: list[Failure]) -> None:
    if not failures:
        return
    lines = "\n".join(f"[bold]{f.benchmark}[/]: {f.error}" for f in failures)
    console.print(Panel(lines, title=f"{len(failures)} benchmark(s) FAILED", border_style="red"))
