"""fila-bench: aggregate and compare on small files, failure reporting, one tiny real run.

The regression tools are what CI trusts to pass or fail a pull request, so their exit
codes are pinned here: regressed -> 1, within threshold -> 0, unreadable input -> 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import fila_bench.cli
from fila_bench.case import Case, Context
from fila_bench.cli import main
from fila_bench.load import CheckFailed, check_at_most_once, check_exactly_once
from fila_bench.results import Result


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


def test_tiny_real_run_writes_valid_json(tmp_path: Path) -> None:
    """One real broker, one short window: the whole path from CLI to JSON."""
    out = tmp_path / "results.json"
    argv = [
        sys.executable,
        "-m",
        "fila_bench",
        "system",
        "--quick",
        "--only",
        "enqueue_1kb_sync_1p",
        "--measure-seconds",
        "0.5",
        "--warmup-seconds",
        "0",
        "--out",
        str(out),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert isinstance(doc["commit"], str) and doc["commit"]
    datetime.fromisoformat(doc["timestamp"])
    [bench] = doc["benchmarks"]
    assert bench["name"] == "enqueue_1kb_sync_1p"
    assert bench["unit"] == "msg/s" and bench["higher_is_better"] is True
    assert bench["value"] > 0
    assert "enqueue_1kb_sync_1p" in proc.stdout
