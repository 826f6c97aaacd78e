"""The `fila-bench` command: `system`, `aggregate`, `compare`, `charts` and `spread`.

`aggregate` and `compare` are also plain click commands so they can be installed as
the `bench-aggregate` and `bench-compare` scripts SPEC 8 names. Exit codes: 0 all
good; 1 a benchmark failed its check (`system`), or a benchmark regressed or the new
run had failures (`compare`); 2 bad input (unreadable results file, unknown name).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import click
from rich.console import Console

from fila_bench.aggregate import aggregate as aggregate_reports
from fila_bench.benchmarks import all_cases
from fila_bench.charts import ChartsUnavailable, write_charts
from fila_bench.compare import ThresholdsError, load_thresholds, regressions
from fila_bench.compare import compare as compare_reports
from fila_bench.cpus import PinningError, plan
from fila_bench.profile import FULL, QUICK
from fila_bench.report import compare_markdown, compare_table, print_failures, results_table
from fila_bench.results import Report, ResultsFileError, load_report
from fila_bench.runner import UnknownBenchmark, run_all, select
from fila_bench.spread import spread as spread_of
from fila_bench.spread import spread_markdown

_LOG_WIDTH = 120


class BadInput(click.ClickException):
    exit_code = 2


def _console() -> Console:
    """Rich sizes tables to the terminal, and to 80 columns when there is none; CI logs
    do not wrap, so give them room for a full row instead of truncated cells."""
    console = Console()
    return console if console.is_terminal else Console(width=_LOG_WIDTH)


@click.group()
def main() -> None:
    """Fila's self-benchmark and its CI regression tools."""


@main.command()
@click.option("--quick", is_flag=True, help="Smaller counts and windows (about two minutes).")
@click.option(
    "--only",
    default="",
    metavar="NAME,...",
    help="Run only these cases or results (names from --list; wildcards allowed).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results.json"),
    show_default=True,
    help="JSON results file.",
)
@click.option(
    "--measure-seconds",
    type=click.FloatRange(min=0.1),
    help="Override the measurement window of time-bounded benchmarks.",
)
@click.option(
    "--warmup-seconds",
    type=click.FloatRange(min=0.0),
    help="Override the warmup before each measurement window.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep broker logs and configs here (default: a temporary directory).",
)
@click.option(
    "--charts",
    "charts_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Also write PNG charts of the results into this directory (needs matplotlib).",
)
@click.option(
    "--cpus",
    default="auto",
    show_default=True,
    metavar="auto|off|S:C",
    help="Pin brokers and the echo server to CPUs S and this load generator to C "
    "(auto: the last CPU for servers, the rest for the load generator).",
)
@click.option(
    "--telemetry-scrape",
    "telemetry_scrape_s",
    type=click.FloatRange(min=0.1),
    metavar="SECONDS",
    help="Run every broker with a Prometheus endpoint and scrape it this often, to "
    "compare against a run without (telemetry is off by default).",
)
@click.option("--list", "list_only", is_flag=True, help="List benchmarks and exit.")
def system(
    quick: bool,
    only: str,
    out: Path,
    measure_seconds: float | None,
    warmup_seconds: float | None,
    workdir: Path | None,
    charts_dir: Path | None,
    cpus: str,
    telemetry_scrape_s: float | None,
    list_only: bool,
) -> None:
    """Start real brokers and benchmark them through fila_sdk (SPEC 8)."""
    console = _console()
    cases = all_cases()
    if list_only:
        for case in cases:
            console.print(f"[bold]{case.name}[/]: {', '.join(case.all_outputs)}")
        return
    try:
        selected = select(cases, [p.strip() for p in only.split(",") if p.strip()])
        placement = plan(cpus)
    except (UnknownBenchmark, PinningError) as exc:
        raise BadInput(f"{exc} (see fila-bench system --help)") from None
    profile = QUICK if quick else FULL
    if measure_seconds is not None:
        profile = dataclasses.replace(profile, measure_s=measure_seconds)
    if warmup_seconds is not None:
        profile = dataclasses.replace(profile, warmup_s=warmup_seconds)
    if telemetry_scrape_s is not None:
        profile = dataclasses.replace(profile, telemetry_scrape_s=telemetry_scrape_s)

    _warn_if_busy(console)
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        report = run_all(selected, profile, workdir, Console(stderr=True), placement)
    else:
        with tempfile.TemporaryDirectory(prefix="fila-bench-") as tmp:
            report = run_all(selected, profile, Path(tmp), Console(stderr=True), placement)

    report.write(out)
    title = f"fila-bench system ({profile.name}, commit {report.commit[:12]})"
    console.print(results_table(report, title))
    console.print(f"results written to {out}")
    if charts_dir is not None:
        _write_charts(console, report, charts_dir)
    print_failures(console, report.failures)
    if report.failures:
        raise SystemExit(1)


def _write_charts(console: Console, report: Report, out_dir: Path) -> None:
    try:
        paths = write_charts(report, out_dir)
    except ChartsUnavailable as exc:
        raise BadInput(str(exc)) from None
    console.print(f"{len(paths)} chart(s) written to {out_dir}")


def _warn_if_busy(console: Console) -> None:
    """The broker and the load generator need a core each; say so when others compete."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > cpus / 2:
        console.print(
            f"[yellow]warning: load average {load:.1f} on {cpus} CPU(s) before starting; "
            "other work on this host will show up as noise in the numbers[/]"
        )


@main.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("inputs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
def aggregate(out: Path, inputs: tuple[Path, ...]) -> None:
    """Write the per-benchmark median of INPUTS (results files) to OUT."""
    try:
        result = aggregate_reports([load_report(p) for p in inputs])
    except ResultsFileError as exc:
        raise BadInput(str(exc)) from None
    result.write(out)
    console = _console()
    console.print(results_table(result, f"median of {len(inputs)} run(s)"))
    console.print(f"written to {out}")


@main.command()
@click.argument("base", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("new", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("threshold_pct", type=click.FloatRange(min=0.0))
@click.option(
    "--markdown",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the comparison as Markdown (the pull-request comment) to this file.",
)
@click.option(
    "--thresholds",
    "thresholds_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Per-figure noise thresholds (TOML) instead of the packaged thresholds.toml.",
)
def compare(
    base: Path,
    new: Path,
    threshold_pct: float,
    markdown: Path | None,
    thresholds_file: Path | None,
) -> None:
    """Compare NEW results with BASE; exit 1 if a gated benchmark is worse by more
    than THRESHOLD_PCT percent, or than its own noise threshold where that is larger
    (msg/s or ratio lower, or ms/us/MiB higher), or if NEW lists failed benchmarks."""
    try:
        base_report, new_report = load_report(base), load_report(new)
        thresholds = load_thresholds(thresholds_file)
    except (ResultsFileError, ThresholdsError) as exc:
        raise BadInput(str(exc)) from None
    rows = compare_reports(base_report, new_report, threshold_pct, thresholds)
    console = _console()
    console.print(compare_table(rows, threshold_pct))
    if markdown is not None:
        text = compare_markdown(
            rows, threshold_pct, new_report.failures, base_report.commit, new_report.commit
        )
        markdown.write_text(text, encoding="utf-8")
    print_failures(console, new_report.failures)
    worse = regressions(rows)
    if worse:
        names = ", ".join(r.name for r in worse)
        console.print(f"[bold red]{len(worse)} regression(s) past {threshold_pct:g}%:[/] {names}")
    else:
        console.print(f"[green]no regression past {threshold_pct:g}%[/]")
    # A benchmark that failed its check in the new run is worse than any regression.
    if worse or new_report.failures:
        raise SystemExit(1)


@main.command()
@click.argument("results", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
def charts(results: Path, out_dir: Path) -> None:
    """Write PNG charts of a RESULTS file (a run or an aggregate) into OUT_DIR."""
    try:
        report = load_report(results)
    except ResultsFileError as exc:
        raise BadInput(str(exc)) from None
    _write_charts(_console(), report, out_dir)


@main.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--markdown",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the table as Markdown to this file.",
)
def spread(inputs: tuple[Path, ...], markdown: Path | None) -> None:
    """Run-to-run spread of every figure over INPUTS (runs of one commit), with the
    threshold each gated figure would need to stay clear of it."""
    try:
        reports = [load_report(p) for p in inputs]
    except ResultsFileError as exc:
        raise BadInput(str(exc)) from None
    text = spread_markdown(spread_of(reports), len(reports))
    click.echo(text)
    if markdown is not None:
        markdown.write_text(text, encoding="utf-8")
