"""PNG charts with matplotlib: throughput against connections, batched bars, latency.

Throughput charts plot the median with the min-max range as error bars on a log
connection axis (1, 8, 50), one line per broker, enqueue and drain side by side, one
file per durability mode. The batched chart is grouped bars; a broker without
batching gets no bar and an "n/a" label instead of a zero that would read as a
measurement. Failing cells are drawn hollow so a chart never hides a failed check.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on these machines

import matplotlib.pyplot as plt
from matplotlib.axes import Axes

from competitive.model import MODES, Mode, Row
from competitive.report.markdown import Index
from competitive.report.summary import Summary

_COLORS = {
    "fila": "#d62728",
    "redis": "#1f77b4",
    "nats": "#2ca02c",
    "rabbitmq": "#ff7f0e",
    "beanstalkd": "#9467bd",
}
_DPI = 110


def _errors(rows: Sequence[Row]) -> list[list[float]]:
    low = [(r.value or 0) - (r.min if r.min is not None else r.value or 0) for r in rows]
    high = [(r.max if r.max is not None else r.value or 0) - (r.value or 0) for r in rows]
    return [low, high]


def _throughput_axis(ax: Axes, ix: Index, mode: Mode, workload: str, size: int) -> None:
    for broker in ix.brokers:
        rows = [
            r
            for (k, r) in sorted(ix.by_key.items())
            if k.broker == broker
            and k.mode == mode
            and k.workload == workload
            and k.batching == "none"
            and k.payload_bytes == size
            and r.value is not None
        ]
        if not rows:
            continue
        xs = [r.connections or 0 for r in rows]
        ys = [r.value or 0.0 for r in rows]
        color = _COLORS.get(broker, "#7f7f7f")
        label = ix.title(broker, mode)
        ax.errorbar(xs, ys, yerr=_errors(rows), marker="o", capsize=3, color=color, label=label)
        failed = [r for r in rows if r.failed]
        if failed:  # a failed check gets a black ring: the number is not to be trusted
            ax.plot(
                [r.connections or 0 for r in failed],
                [r.value or 0.0 for r in failed],
                linestyle="none",
                marker="o",
                markersize=12,
                markerfacecolor="none",
                markeredgecolor="black",
            )
    ax.set_xscale("log")
    ax.set_xticks([1, 8, 50], labels=["1", "8", "50"])
    ax.set_xlabel("connections (one job in flight each)")
    ax.set_ylabel("jobs/s")
    ax.set_title(f"{workload}")
    ax.grid(True, alpha=0.3)


def _broker_ticks(ax: Axes, ix: Index, mode: Mode) -> None:
    labels = [ix.title(b, mode) for b in ix.brokers]
    ax.set_xticks(range(len(labels)), labels=labels, rotation=20, fontsize=8)


def throughput(summary: Summary, mode: Mode, path: Path, size: int = 256) -> Path:
    ix = Index(summary.rows, summary.machine)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, workload in zip(axes, ("enqueue", "drain"), strict=True):
        _throughput_axis(ax, ix, mode, workload, size)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"{mode.capitalize()}: throughput against connections ({size}-byte jobs)")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def batched(summary: Summary, path: Path, size: int = 256) -> Path:
    ix = Index(summary.rows, summary.machine)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.38
    for ax, mode in zip(axes, MODES, strict=True):
        for i, broker in enumerate(ix.brokers):
            for j, workload in enumerate(("enqueue", "drain")):
                row = ix.get(broker, mode, workload, 1, size, "native")
                x = i + (j - 0.5) * width
                if row is None or row.value is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8)
                    continue
                ax.bar(
                    x,
                    row.value,
                    width,
                    color=_COLORS.get(broker, "#7f7f7f"),
                    hatch="" if j == 0 else "//",
                    fill=not row.failed,
                    edgecolor="black",
                    yerr=_errors([row]),
                    capsize=2,
                )
        _broker_ticks(ax, ix, mode)
        ax.set_xlim(-0.6, len(ix.brokers) - 0.4)
        ax.set_title(f"{mode}: enqueue (plain) and drain (hatched)")
        ax.set_ylabel("msg/s")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Batched: one producer, one consumer, each client's own batching")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def latency(summary: Summary, path: Path, size: int = 256) -> Path:
    ix = Index(summary.rows, summary.machine)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    width = 0.27
    workloads = ("latency_p50", "latency_p99", "latency_p999")
    for ax, mode in zip(axes, MODES, strict=True):
        for i, broker in enumerate(ix.brokers):
            for j, workload in enumerate(workloads):
                row = ix.get(broker, mode, workload, 1, size)
                if row is None or row.value is None:
                    continue
                ax.bar(
                    i + (j - 1) * width,
                    row.value,
                    width,
                    color=_COLORS.get(broker, "#7f7f7f"),
                    alpha=1.0 - 0.3 * j,
                    fill=not row.failed,
                    edgecolor="black",
                )
        ax.set_yscale("log")
        _broker_ticks(ax, ix, mode)
        ax.set_title(f"{mode}: p50, p99, p999 (lighter = higher)")
        ax.set_ylabel("ms (log)")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Round trip enqueue, reserve, ack on one connection")
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def write_all(summary: Summary, out: Path, size: int = 256) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [throughput(summary, mode, out / f"throughput_{mode}.png", size) for mode in MODES]
    paths.append(batched(summary, out / "batched.png", size))
    paths.append(latency(summary, out / "latency.png", size))
    return paths
