"""fila-bench: aggregate and compare on small files, failure reporting, one tiny real run.

The regression tools are what CI trusts to pass or fail a pull request, so their exit
codes are pinned here: regressed -> 1, within threshold -> 0, unreadable input -> 2.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import fila_bench.cli
from fila_bench.benchmarks.scheduling import FAIRNESS_WEIGHTS, max_window_deviation
from fila_bench.benchmarks.throttle import steady_rate
from fila_bench.case import Case, Context
from fila_bench.cli import main
from fila_bench.cpus import PinningError, plan
from fila_bench.load import CheckFailed, check_at_most_once, check_exactly_once, paced
from fila_bench.results import Result, throughput
from fila_bench.runner import ceiling_rows, with_ratios
from fila_bench.spread import Spread, gate_dev_pct


def entry(name: str, value: float, unit: str, higher: bool, gated: bool = True) -> dict[str, Any]:
    return {"name": name, "value": value, "unit": unit, "higher_is_better": higher, "gated": gated}


def write(path: Path, *entries: dict[str, Any], commit: str = "abc") -> Path:
    doc = {"commit": commit, "timestamp": "2026-01-01T00:00:00+00:00", "benchmarks": list(entries)}
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), prog_name="fila-bench")


BASE = (
    entry("enqueue", 1000, "msg/s", True),
    entry("latency_p99_ms", 10.0, "ms", False),
    entry("lua_overhead_us", 5.0, "us", False, gated=False),
)


def test_aggregate_takes_the_median_per_benchmark(tmp_path: Path) -> None:
    runs = [
        write(
            tmp_path / f"run{i}.json",
            entry("enqueue", v, "msg/s", True),
            entry("latency_p99_ms", ms, "ms", False),
        )
        for i, (v, ms) in enumerate([(900, 12.0), (1100, 9.0), (1000, 30.0)])
    ]
    out = tmp_path / "median.json"
    result = invoke("aggregate", str(out), *map(str, runs))
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    values = {b["name"]: b["value"] for b in doc["benchmarks"]}
    assert values == {"enqueue": 1000, "latency_p99_ms": 12.0}
    assert doc["commit"] == "abc" and doc["runs"] == 3
    assert all(b["higher_is_better"] == (b["unit"] == "msg/s") for b in doc["benchmarks"])


@pytest.mark.parametrize(
    ("new", "threshold", "exit_code"),
    [
        # throughput down 20%: a regression past 10%
        ((entry("enqueue", 800, "msg/s", True),), 10, 1),
        # latency up 20%: lower is better, so also a regression
        ((entry("latency_p99_ms", 12.0, "ms", False),), 10, 1),
        # both within the threshold
        ((entry("enqueue", 950, "msg/s", True), entry("latency_p99_ms", 10.5, "ms", False)), 10, 0),
        # big improvements in both directions never fail
        ((entry("enqueue", 5000, "msg/s", True), entry("latency_p99_ms", 1.0, "ms", False)), 10, 0),
        # an ungated entry may move as it likes
        ((entry("lua_overhead_us", 50.0, "us", False, gated=False),), 10, 0),
        # the same 20% drop passes a 25% threshold
        ((entry("enqueue", 800, "msg/s", True),), 25, 0),
    ],
)
def test_compare_exit_code_follows_direction_and_threshold(
    tmp_path: Path, new: tuple[dict[str, Any], ...], threshold: float, exit_code: int
) -> None:
    by_name = {e["name"]: e for e in BASE} | {e["name"]: e for e in new}
    base_file = write(tmp_path / "base.json", *BASE)
    new_file = write(tmp_path / "new.json", *by_name.values())
    result = invoke("compare", str(base_file), str(new_file), str(threshold))
    assert result.exit_code == exit_code, result.output
    assert ("REGRESSED" in result.output) == (exit_code == 1)


def test_compare_infers_direction_for_entries_without_it(tmp_path: Path) -> None:
    old_style = {"name": "enqueue", "value": 1000, "unit": "msg/s"}
    base_file = write(tmp_path / "base.json", old_style)
    new_file = write(tmp_path / "new.json", old_style | {"value": 500})
    assert invoke("compare", str(base_file), str(new_file), "10").exit_code == 1


def test_compare_missing_or_new_benchmarks_do_not_fail(tmp_path: Path) -> None:
    base_file = write(tmp_path / "base.json", *BASE)
    new_file = write(tmp_path / "new.json", BASE[0], entry("brand_new", 1, "msg/s", True))
    result = invoke("compare", str(base_file), str(new_file), "10")
    assert result.exit_code == 0, result.output
    assert "missing" in result.output and "new" in result.output


def test_compare_fails_when_the_new_run_had_failures(tmp_path: Path) -> None:
    base_file = write(tmp_path / "base.json", *BASE)
    new_file = write(tmp_path / "new.json", *BASE)
    doc = json.loads(new_file.read_text())
    doc["failures"] = [{"benchmark": "durable_8c", "error": "conservation check failed"}]
    new_file.write_text(json.dumps(doc))
    result = invoke("compare", str(base_file), str(new_file), "10")
    assert result.exit_code == 1
    assert "conservation check failed" in result.output


def test_unreadable_input_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    good = write(tmp_path / "good.json", *BASE)
    assert invoke("compare", str(bad), str(good), "10").exit_code == 2
    assert invoke("compare", str(tmp_path / "absent.json"), str(good), "10").exit_code == 2
    assert invoke("aggregate", str(tmp_path / "out.json"), str(bad)).exit_code == 2


def test_unknown_benchmark_name_exits_2() -> None:
    result = invoke("system", "--only", "no_such_benchmark")
    assert result.exit_code == 2
    assert "no_such_benchmark" in result.output


def test_conservation_checks() -> None:
    check_exactly_once("q", ["a", "b"], ["b", "a"])
    check_at_most_once("q", ["a", "b", "c"], ["c"])
    with pytest.raises(CheckFailed, match="1 delivered more than once"):
        check_exactly_once("q", ["a", "b"], ["a", "b", "a"])
    with pytest.raises(CheckFailed, match="1 missing"):
        check_exactly_once("q", ["a", "b"], ["a"])
    with pytest.raises(CheckFailed, match="1 never enqueued"):
        check_at_most_once("q", ["a"], ["a", "z"])


def test_failed_check_is_reported_and_exits_nonzero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def fails(ctx: Context) -> list[Result]:
        raise CheckFailed("lost 3 messages", [Result("x_rate", 5.0, "msg/s", True)])

    async def passes(ctx: Context) -> list[Result]:
        return [Result("y_rate", 7.0, "msg/s", True)]

    cases = [Case("bad", ("x_rate",), fails), Case("good", ("y_rate",), passes)]
    monkeypatch.setattr(fila_bench.cli, "all_cases", lambda: cases)
    out = tmp_path / "r.json"
    result = invoke("system", "--out", str(out))
    assert result.exit_code == 1
    assert "lost 3 messages" in result.output and "FAILED" in result.output
    doc = json.loads(out.read_text())
    assert doc["failures"] == [{"benchmark": "bad", "error": "lost 3 messages"}]
    assert [b["name"] for b in doc["benchmarks"]] == ["x_rate", "y_rate"]


def _real_run(
    tmp_path: Path, only: str, measure_seconds: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """`fila-bench system --quick --only ONLY` with no warm-up, as a user runs it; must pass."""
    out = tmp_path / "results.json"
    argv = [
        sys.executable,
        "-m",
        "fila_bench",
        "system",
        "--quick",
        "--only",
        only,
        "--measure-seconds",
        measure_seconds,
        "--warmup-seconds",
        "0",
        "--out",
        str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc: dict[str, Any] = json.loads(out.read_text())
    return proc, doc


def test_tiny_real_run_writes_valid_json(tmp_path: Path) -> None:
    """One real broker, one short window: the whole path from CLI to JSON, with the echo
    ceiling measured around the case and the rate reported as a ratio to it."""
    proc, doc = _real_run(tmp_path, "enqueue_1kb_sync_50p", "0.5")
    assert isinstance(doc["commit"], str) and doc["commit"]
    datetime.fromisoformat(doc["timestamp"])
    by_name = {b["name"]: b for b in doc["benchmarks"]}
    assert set(by_name) == {
        "enqueue_1kb_sync_50p",
        "enqueue_1kb_sync_50p_ratio",
        "echo_ceiling_50c",
        "echo_ceiling_50c_spread_pct",
    }
    raw, ratio, ceiling = (
        by_name["enqueue_1kb_sync_50p"],
        by_name["enqueue_1kb_sync_50p_ratio"],
        by_name["echo_ceiling_50c"],
    )
    assert raw["unit"] == "msg/s" and raw["higher_is_better"] is True and raw["value"] > 0
    # the raw rate is kept for comparison with published figures; the ratio is gated
    assert raw["gated"] is False and ratio["gated"] is True
    # the SDK coalesces concurrent enqueues per connection, so well above 1 is expected
    assert ceiling["value"] > 0 and 0 < ratio["value"] < 50
    assert "enqueue_1kb_sync_50p" in proc.stdout


def test_paired_ratio_loads_both_brokers_and_checks_what_they_stored(tmp_path: Path) -> None:
    """`durable_over_buffered_50c`: two real brokers at once, alternating slices, and a
    depth check on each afterwards (it fails the run if an answered id was not stored)."""
    _, doc = _real_run(tmp_path, "durable_over_buffered_50c", "1")
    assert "failures" not in doc or not doc["failures"]
    (figure,) = doc["benchmarks"]  # a ratio of two rates of this run: no echo ceiling
    assert figure["name"] == "durable_over_buffered_50c" and figure["unit"] == "ratio"
    assert figure["higher_is_better"] is True and figure["gated"] is False
    # both modes were measured: a mode that got no slice would make this 0 or fail
    assert 0.1 < figure["value"] < 3


# --- per-figure noise thresholds, Markdown, missing figures ---------------------------


def test_compare_holds_each_figure_to_its_noise_threshold(tmp_path: Path) -> None:
    base_file = write(tmp_path / "base.json", entry("noisy_ratio", 1.0, "ratio", True))
    floors = tmp_path / "thresholds.toml"
    floors.write_text("[thresholds]\nnoisy_ratio = 25\n")
    within = write(tmp_path / "within.json", entry("noisy_ratio", 0.8, "ratio", True))
    past = write(tmp_path / "past.json", entry("noisy_ratio", 0.7, "ratio", True))
    # 20% down: past the 10% asked for, within the figure's own 25%
    args = ["--thresholds", str(floors)]
    assert invoke("compare", str(base_file), str(within), "10", *args).exit_code == 0
    # 30% down: past both
    result = invoke("compare", str(base_file), str(past), "10", *args)
    assert result.exit_code == 1 and "REGRESSED" in result.output
    # the command-line threshold wins where it is the larger
    assert invoke("compare", str(base_file), str(past), "35", *args).exit_code == 0


def test_compare_writes_markdown_for_the_pull_request(tmp_path: Path) -> None:
    base_file = write(tmp_path / "base.json", *BASE, commit="a" * 40)
    new_file = write(
        tmp_path / "new.json",
        entry("enqueue", 800, "msg/s", True),
        BASE[1],
        entry("lua_overhead_us", 9.0, "us", False, gated=False),
        commit="b" * 40,
    )
    md = tmp_path / "compare.md"
    result = invoke("compare", str(base_file), str(new_file), "10", "--markdown", str(md))
    assert result.exit_code == 1
    text = md.read_text()
    assert text.startswith("### fila-bench: FAIL")
    assert "**1 regression(s):** `enqueue`" in text
    assert "| `enqueue` ↑ | msg/s | 1,000 | 800 | -20.0% | 10% | **REGRESSED** |" in text
    # informational figures are folded away, without a limit column
    assert "<details><summary>1 informational figure(s), not gated</summary>" in text
    gated_part, info_part = text.split("<details>")
    assert "lua_overhead_us" not in gated_part and "`enqueue`" not in info_part
    assert "| `lua_overhead_us` ↓ | us | 5.000 | 9.000 | +80.0% | info |" in text
    assert "`aaaaaaaaaaaa`" in text and "`bbbbbbbbbbbb`" in text


def test_markdown_of_a_clean_comparison_says_pass(tmp_path: Path) -> None:
    base_file = write(tmp_path / "base.json", *BASE)
    md = tmp_path / "compare.md"
    assert (
        invoke("compare", str(base_file), str(base_file), "10", "--markdown", str(md)).exit_code
        == 0
    )
    assert md.read_text().startswith("### fila-bench: pass")


def test_aggregate_carries_failures_so_compare_fails(tmp_path: Path) -> None:
    good = write(tmp_path / "good.json", *BASE)
    bad = write(tmp_path / "bad.json", *BASE)
    doc = json.loads(bad.read_text())
    doc["failures"] = [{"benchmark": "fairness", "error": "2.1 pp off"}]
    bad.write_text(json.dumps(doc))
    median = tmp_path / "median.json"
    assert invoke("aggregate", str(median), str(good), str(bad), str(good)).exit_code == 0
    result = invoke("compare", str(good), str(median), "10")
    assert result.exit_code == 1 and "2.1 pp off" in result.output


def test_a_case_missing_a_promised_figure_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def partial(ctx: Context) -> list[Result]:
        return [Result("a_rate", 5.0, "msg/s", True)]

    cases = [Case("partial", ("a_rate", "b_rate", "c_opt"), partial, optional=("c_opt",))]
    monkeypatch.setattr(fila_bench.cli, "all_cases", lambda: cases)
    out = tmp_path / "r.json"
    result = invoke("system", "--out", str(out), "--cpus", "off")
    assert result.exit_code == 1
    doc = json.loads(out.read_text())
    assert doc["failures"] == [{"benchmark": "partial", "error": "no figure for b_rate"}]


def test_ratios_are_gated_and_their_raw_rates_are_not() -> None:
    results = [
        Result("x_rate", 3000.0, "msg/s", True),
        Result("x_overhead_pct", 2.0, "%", False, gated=False),
        Result("y_p99_ms", 4.0, "ms", False),
    ]
    results.append(throughput("one_conn_rate", 600.0, latency_bound=True))
    out = {r.name: r for r in with_ratios(results, ("x_rate", "one_conn_rate"), 6000.0)}
    assert out["x_rate_ratio"] == Result("x_rate_ratio", 0.5, "ratio", True, True)
    assert out["x_rate"].gated is False and out["x_rate"].value == 3000.0
    # one call in flight: a round trip, not broker work; reported, never gated
    assert out["one_conn_rate_ratio"] == Result("one_conn_rate_ratio", 0.1, "ratio", True, False)
    assert out["y_p99_ms"].gated is True and "x_overhead_pct_ratio" not in out


def test_ceiling_rows_report_median_and_in_run_spread() -> None:
    ceiling, spread = ceiling_rows([5000.0, 6000.0, 5500.0])
    assert (ceiling.name, ceiling.value, ceiling.gated) == ("echo_ceiling_50c", 5500.0, False)
    assert spread.value == pytest.approx(1000 / 5500 * 100)


# --- figures that mean what their names say ------------------------------------------


def test_fairness_window_slides_over_the_whole_run() -> None:
    """A run that is fair in its first window but not later must be caught."""
    cycle = [f"tenant-{w}" for w in FAIRNESS_WEIGHTS for _ in range(w)]  # exact shares
    fair = cycle * 400  # 6,000 deliveries
    # then 2,000 deliveries in which tenant-5 gets nothing
    skewed = [f"tenant-{w}" for w in (1, 2, 3, 4) for _ in range(w * 2)] * 100
    deviation_fair, _ = max_window_deviation(fair, 5_000, 100)
    assert deviation_fair < 0.1  # windows not aligned to the 15-delivery cycle
    first_window_only, _ = max_window_deviation((fair + skewed)[:5_000], 5_000, 100)
    assert first_window_only < 0.1
    deviation, worst_at = max_window_deviation(fair + skewed, 5_000, 100)
    assert deviation > 5 and worst_at == 3_000


def test_paced_yields_the_schedule_not_the_send() -> None:
    """After a stall, the overdue ticks carry their scheduled times (no coordinated
    omission): latency measured from them includes the wait behind the stall."""

    async def run() -> list[tuple[float, float]]:
        got: list[tuple[float, float]] = []
        async for scheduled in paced(100.0, lambda: len(got) >= 10):
            got.append((scheduled, time.perf_counter()))
            if len(got) == 2:
                await asyncio.sleep(0.05)  # a stalled answer, five ticks long
        return got

    ticks = asyncio.run(run())
    scheduled = [s for s, _ in ticks]
    assert all(b - a == pytest.approx(0.01, abs=1e-6) for a, b in itertools.pairwise(scheduled))
    # the ticks right after the stall were sent late, and say so
    assert ticks[3][1] - ticks[3][0] > 0.02


def test_cpu_plan_parses_and_refuses_overlap() -> None:
    usable = sorted(os.sched_getaffinity(0))
    assert plan("off") is None
    auto = plan("auto")
    if len(usable) >= 2:
        assert auto is not None and auto.server == {usable[-1]} and usable[-1] not in auto.client
    with pytest.raises(PinningError, match="overlap"):
        plan(f"{usable[0]}:{usable[0]}")
    with pytest.raises(PinningError):
        plan("nonsense")


# --- charts, spread -----------------------------------------------------------------


def test_charts_are_valid_pngs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from PIL import Image

    figures = [
        entry(f"{label}_{kind}_{n}c", 1000.0 * n**0.5, "msg/s", True)
        for label in ("durable", "buffered")
        for kind in ("enqueue", "drain")
        for n in (1, 8, 50)
    ]
    figures += [
        entry("echo_ceiling_50c", 6000.0, "msg/s", True, gated=False),
        entry("durable_enqueue_50c_ratio", 0.5, "ratio", True),
        entry("latency_p50_ms", 1.5, "ms", False),
        entry("latency_p99_ms", 3.0, "ms", False),
        *(entry(f"fairness_share_w{w}_pct", w / 15 * 100, "%", True, False) for w in range(1, 6)),
        entry("consume_keys_10", 3000.0, "msg/s", True),
        entry("consume_consumers_100", 3500.0, "msg/s", True),
    ]
    results = write(tmp_path / "r.json", *figures)
    out = tmp_path / "charts"
    result = invoke("charts", str(results), str(out))
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "fairness.png",
        "latency.png",
        "ratio_to_ceiling.png",
        "scaling.png",
        "throughput_vs_connections.png",
    ]
    for path in out.iterdir():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.size == (800, 480)


def test_charts_skip_what_the_results_lack(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = write(tmp_path / "r.json", entry("latency_p50_ms", 1.5, "ms", False))
    out = tmp_path / "charts"
    assert invoke("charts", str(results), str(out)).exit_code == 0
    assert [p.name for p in out.iterdir()] == ["latency.png"]


def test_spread_suggests_a_threshold_above_the_noise(tmp_path: Path) -> None:
    runs = [
        write(tmp_path / f"run{i}.json", entry("r_ratio", v, "ratio", True))
        for i, v in enumerate([0.50, 0.52, 0.48, 0.40, 0.51])
    ]
    md = tmp_path / "spread.md"
    result = invoke("spread", *map(str, runs), "--markdown", str(md))
    assert result.exit_code == 0, result.output
    # median 0.50, worst run 0.40: 20% off; too few runs for two groups of three, so
    # two medians could err 2 x 20% apart; plus a quarter -> 50%
    assert "| `r_ratio` | ratio | yes | 0.5 | 0.4 | 0.52 | 20.0% |" in md.read_text()
    assert md.read_text().rstrip().endswith("| - | 50% |")
    quiet = [Spread("q", "ratio", True, 10, 1.0, 0.99, 1.01, 1.0, 0.5, 1.5)]
    assert quiet[0].suggested_threshold_pct == 10  # never below the CI threshold


def test_spread_holds_thresholds_to_what_the_gate_compares() -> None:
    # Two sessions of the same commit: a fast one, then one 20% slower throughout.
    # Every single run sits within 11% of the median of all six, but the gate would
    # compare a baseline from the first session with a run from the second.
    fast, slow = [1.00, 1.01, 0.99], [0.80, 0.81, 0.79]
    assert gate_dev_pct(fast + slow, higher_is_better=True) == pytest.approx(20.0)
    # A lower-is-better figure regresses upwards: held against the low baseline.
    assert gate_dev_pct([10, 10, 10, 12, 12, 12], higher_is_better=False) == pytest.approx(20.0)
    # One outlier per group is what a median of three absorbs.
    assert gate_dev_pct([1.0, 1.0, 1.0, 1.0, 1.0, 0.2], higher_is_better=True) == 0.0
    assert gate_dev_pct([*fast, 0.8], higher_is_better=True) is None  # not two groups
    row = Spread("r", "ratio", True, 6, 0.9, 0.79, 1.01, 12.2, 10.0, 20.0)
    assert row.suggested_threshold_pct == 25  # 20% plus a quarter


# --- the CI scripts -----------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent


def test_ci_run_exercises_every_script_the_workflows_call() -> None:
    """A workflow step that .ci/run never runs can rot unseen."""
    ci_run = (REPO / ".ci" / "run").read_text()
    called: set[str] = set()
    for workflow in (REPO / ".github" / "workflows").glob("*.yml"):
        for step in yaml_run_lines(workflow.read_text()):
            called.update(re.findall(r"((?:scripts|\.ci)/[\w./-]+)", step))
    assert "scripts/bench-runs.sh" in called and "scripts/bench-compare.sh" in called
    called.discard(".ci/run")  # the ci workflow's one step is .ci/run itself
    missing = sorted(c for c in called if c not in ci_run)
    assert not missing, f"workflows call scripts .ci/run does not run: {missing}"
    for script in called:
        assert (REPO / script).is_file(), script


def yaml_run_lines(text: str) -> list[str]:
    """The `run:` commands of a workflow (single-line or folded), without a YAML parser."""
    lines, out, inside = text.splitlines(), [], False
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("run:"):
            out.append(stripped[4:])
            inside = stripped[4:].strip() in ("|", ">-", ">", "|-")
        elif inside and stripped and not re.match(r"^-?\s*[\w-]+:", stripped):
            out.append(stripped)
        else:
            inside = False
    return out


def test_pr_comment_has_one_marker_and_links_the_run(tmp_path: Path) -> None:
    md = tmp_path / "compare.md"
    md.write_text("### fila-bench: pass\n")
    argv = [
        sys.executable,
        str(REPO / "scripts" / "bench-pr-comment.py"),
        "--body",
        str(md),
        "--repo",
        "o/r",
        "--pr",
        "7",
        "--run-url",
        "https://example.invalid/run/1",
        "--dry-run",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("<!-- fila-bench-regression -->") == 1
    assert "o/r#7" in proc.stdout and "https://example.invalid/run/1" in proc.stdout
    missing = [*argv[:3], str(tmp_path / "absent.md"), *argv[4:]]
    assert subprocess.run(missing, capture_output=True, timeout=30).returncode == 1


def test_throttle_steady_rate_survives_a_stalled_reader() -> None:
    """20/s for 4 s, read by a reader that stalled: the messages the broker sent during
    the stall arrive at once when it resumes, at the window's start or inside it, or
    past its end. The rate is still 20/s, and a leak still shows."""
    on_time = [0.6 + i / 20 for i in range(89)]  # 0.6 s .. 5.0 s

    def window(arrivals: list[float]) -> list[float]:
        return [t for t in arrivals if 1.0 < t <= 5.0]

    bunched_at_start = [max(t, 1.05) for t in on_time]
    stalled_at_end = [5.2 if t > 4.6 else t for t in on_time]
    stalled_inside = [3.0 if 2.5 <= t < 3.0 else t for t in on_time]
    for arrivals in (on_time, bunched_at_start, stalled_at_end, stalled_inside):
        assert steady_rate(window(arrivals)) == pytest.approx(20.0)
    leaking = [1.0 + i / 25 for i in range(101)]
    assert steady_rate(leaking) == pytest.approx(25.0)
    assert steady_rate([1.0]) == 0.0
