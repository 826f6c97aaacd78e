"""PNG charts of a results file, for people reading a pull request or docs/benchmarks.md.

matplotlib is an optional dependency (the `charts` extra): the broker and the
benchmark run without it, and `--charts` says how to install it when it is missing.
Each chart is drawn from whatever figures the file has; a chart none of whose
figures are present is skipped, so a `--only` run still gets the charts it can.
The Agg backend renders without a display, as CI needs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fila_bench.published import PUBLISHED
from fila_bench.results import Report

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CONNECTIONS = (1, 8, 50)
FAIRNESS_WEIGHTS = (1, 2, 3, 4, 5)
KEY_COUNTS = (10, 1_000, 10_000)
CONSUMER_COUNTS = (1, 10, 100)
HEADLINE = "throughput_vs_connections.png"


class ChartsUnavailable(RuntimeError):
    """matplotlib is not installed."""


Values = dict[str, float]


def write_charts(report: Report, out_dir: Path) -> list[Path]:
    """Writes every chart the report has figures for into `out_dir`; returns the paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ChartsUnavailable(
            "charts need matplotlib: pip install -e '.[charts]' (or '.[dev]')"
        ) from None
    values = {r.name: r.value for r in report.results}
    title = f"commit {report.commit[:12]}"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    drawers: list[tuple[str, Callable[[Figure, Values, str], bool]]] = [
        (HEADLINE, _throughput),
        ("ratio_to_ceiling.png", _ratios),
        ("latency.png", _latency),
        ("fairness.png", _fairness),
        ("scaling.png", _scaling),
    ]
    for filename, draw in drawers:
        fig = plt.figure(figsize=(8, 4.8), layout="constrained")
        try:
            if draw(fig, values, title):
                path = out_dir / filename
                fig.savefig(path, dpi=100)
                written.append(path)
        finally:
            plt.close(fig)
    return written


def _series(values: Values, names: list[str]) -> tuple[list[int], list[float]]:
    """The x positions and values of the names present (x = index into names)."""
    xs = [i for i, n in enumerate(names) if n in values]
    return xs, [values[names[i]] for i in xs]


def _throughput(fig: Figure, values: Values, title: str) -> bool:
    ax = fig.add_subplot()
    drawn = False
    for label in ("durable", "buffered"):
        for kind, style in (("enqueue", "-o"), ("drain", "--s")):
            xs, ys = _series(values, [f"{label}_{kind}_{n}c" for n in CONNECTIONS])
            if xs:
                ax.plot([CONNECTIONS[i] for i in xs], ys, style, label=f"{label} {kind}")
                drawn = True
    if not drawn:
        return False
    if "echo_ceiling_50c" in values:
        ax.axhline(values["echo_ceiling_50c"], color="grey", linestyle=":", label="echo ceiling")
    ax.set_xscale("log")
    ax.set_xticks(CONNECTIONS, [str(c) for c in CONNECTIONS])
    ax.set_xlabel("connections (one 256 B call in flight each)")
    ax.set_ylabel("msg/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Throughput against connections ({title})")
    ax.legend()
    ax.grid(alpha=0.3)
    return True


def _ratios(fig: Figure, values: Values, title: str) -> bool:
    names = [n for n in values if n.endswith("_ratio")]
    if not names:
        return False
    ax = fig.add_subplot()
    ax.barh(names, [values[n] for n in names])
    ax.invert_yaxis()
    ax.axvline(1.0, color="grey", linestyle=":")
    ax.set_xlabel("ratio to echo_ceiling_50c of the same run")
    ax.set_title(f"Closed-loop rates against the stack's ceiling ({title})")
    ax.tick_params(axis="y", labelsize=7)
    return True


def _latency(fig: Figure, values: Values, title: str) -> bool:
    names = ["latency_p50_ms", "latency_p95_ms", "latency_p99_ms"]
    xs, ys = _series(values, names)
    if not xs:
        return False
    ax = fig.add_subplot()
    width = 0.27
    ours = ax.bar([i - width for i in xs], ys, width, label="ours")
    ax.bar_label(ours, fmt="%.2f")
    floor_names = [f"latency_floor_{names[i].split('_')[1]}_ms" for i in xs]
    if all(n in values for n in floor_names):
        floor = ax.bar(
            xs,
            [values[n] for n in floor_names],
            width,
            color="tab:green",
            label="the floor: bare gRPC server + fdatasync, same run",
        )
        ax.bar_label(floor, fmt="%.2f")
    theirs = ax.bar(
        [i + width for i in xs],
        [PUBLISHED[names[i]] for i in xs],
        width,
        color="lightgrey",
        label="Rust Fila, published (theirs, their hardware)",
    )
    ax.bar_label(theirs, fmt="%.2f")
    ax.set_xticks(xs, [names[i].split("_")[1] for i in xs])
    ax.set_ylabel("ms, enqueue to delivery (from the scheduled send)")
    ax.set_title(f"Latency at 200 msg/s, durable ({title})")
    ax.legend()
    return True


def _fairness(fig: Figure, values: Values, title: str) -> bool:
    xs, ys = _series(values, [f"fairness_share_w{w}_pct" for w in FAIRNESS_WEIGHTS])
    if not xs:
        return False
    ax = fig.add_subplot()
    weights = [FAIRNESS_WEIGHTS[i] for i in xs]
    total = sum(FAIRNESS_WEIGHTS)
    width = 0.4
    ax.bar(
        [w - width / 2 for w in weights],
        [w / total * 100 for w in weights],
        width,
        label="weight's share",
    )
    ax.bar([w + width / 2 for w in weights], ys, width, label="delivered share")
    ax.set_xticks(weights, [f"weight {w}" for w in weights])
    ax.set_ylabel("% of deliveries")
    deviation = values.get("fairness_max_deviation_pp")
    worst = f"; worst window {deviation:.2f} pp off" if deviation is not None else ""
    ax.set_title(f"Fairness: shares against weights{worst} ({title})")
    ax.legend()
    return True


def _scaling(fig: Figure, values: Values, title: str) -> bool:
    keys = _series(values, [f"consume_keys_{k}" for k in KEY_COUNTS])
    consumers = _series(values, [f"consume_consumers_{c}" for c in CONSUMER_COUNTS])
    if not keys[0] and not consumers[0]:
        return False
    left, right = fig.subplots(1, 2)
    for ax, (xs, ys), levels, label, prefix in (
        (left, keys, KEY_COUNTS, "fairness keys", "consume_keys_"),
        (right, consumers, CONSUMER_COUNTS, "consumers", "consume_consumers_"),
    ):
        ax.plot([levels[i] for i in xs], ys, "-o", label="ours")
        theirs = [PUBLISHED[f"{prefix}{n}"] for n in levels]
        ax.plot(levels, theirs, ":s", color="grey", label="Rust Fila, published (theirs)")
        ax.legend(fontsize=8)
        ax.set_xscale("log")
        ax.set_xticks(levels, [f"{n:,}" for n in levels])
        ax.set_xlabel(label)
        ax.set_ylabel("deliveries/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Consume rate against keys and consumers ({title})")
    return True
