"""`RESULTS.md`: the run as Markdown tables shaped like the seed reports.

Headline tables (50 connections, durable and buffered: enqueue, drain, latency),
throughput against connections, the batched table, payload sizes, lifecycle, three
producers, resources, the settings each broker ran with, and the published figures of
brokers that cannot run here in a table of their own. Each measured cell is the
median with min-max beside it when there were several repetitions; a cell whose
conservation check failed carries a warning sign and is listed under "Failures", and
a cell that was not measured says "n/a" (never a number).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from competitive.model import MODES, CellKey, Mode, Row
from competitive.published import PUBLISHED
from competitive.report.summary import Summary

WARN = "⚠"
BROKER_ORDER = ("fila", "redis", "nats", "rabbitmq", "beanstalkd")
HEADLINE_CONNECTIONS = 50


def fmt_number(value: float, unit: str) -> str:
    """Rates as whole numbers with separators, milliseconds with three decimals."""
    if unit == "ms":
        return f"{value:.3f}"
    if unit in ("s", "MiB"):
        return f"{value:,.1f}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:,.1f}"


def fmt_cell(row: Row | None, *, show_range: bool = True) -> str:
    if row is None:
        return "-"
    if not row.available:
        return "n/a"
    if row.value is None:
        return f"{WARN} error"
    text = fmt_number(row.value, row.unit)
    if show_range and row.reps > 1 and row.min is not None and row.max is not None:
        text += f" ({fmt_number(row.min, row.unit)}-{fmt_number(row.max, row.unit)})"
    if row.failed:
        text += f" {WARN}"
    return text


def table(header: Sequence[str], body: Iterable[Sequence[str]], align: str = "") -> str:
    """A Markdown table; `align` is one letter per column (l or r), default l then r."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


class Index:
    """Rows by key, and the brokers present in run order."""

    def __init__(self, rows: Sequence[Row], machine: dict[str, Any]) -> None:
        self.by_key: dict[CellKey, Row] = {r.key: r for r in rows}
        present = {r.broker for r in rows}
        self.brokers = [b for b in BROKER_ORDER if b in present] + sorted(
            present - set(BROKER_ORDER)
        )
        self.info: dict[str, dict[str, Any]] = machine.get("brokers", {})

    def get(
        self,
        broker: str,
        mode: Mode,
        workload: str,
        connections: int | None,
        payload: int | None,
        batching: str = "none",
    ) -> Row | None:
        key = CellKey(broker, mode, batching, workload, connections, payload)  # type: ignore[arg-type]
        return self.by_key.get(key)

    def title(self, broker: str, mode: Mode | None = None) -> str:
        info = self.info.get(broker, {})
        name = str(info.get("title", broker))
        if mode is not None and info.get("notes", {}).get(mode):
            name += " †"
        return name


def _job_bytes(rows: Sequence[Row]) -> int:
    sizes = [r.payload_bytes for r in rows if r.workload == "latency_p50" and r.payload_bytes]
    return sizes[0] if sizes else 256


def headline(ix: Index, mode: Mode, size: int, connections: int) -> str:
    body = []
    for b in ix.brokers:
        cells = [
            fmt_cell(ix.get(b, mode, "enqueue", connections, size)),
            fmt_cell(ix.get(b, mode, "drain", connections, size)),
        ]
        cells += [
            fmt_cell(ix.get(b, mode, w, 1, size))
            for w in ("latency_p50", "latency_p99", "latency_p999")
        ]
        body.append([ix.title(b, mode), *cells])
    header = [
        "broker",
        f"enqueue jobs/s ({connections} conn.)",
        f"drain jobs/s ({connections} conn.)",
        "p50 ms",
        "p99 ms",
        "p999 ms",
    ]
    return table(header, body)


def scaling(ix: Index, mode: Mode, size: int, connections: Sequence[int]) -> str:
    body = []
    for n in connections:
        cells = []
        for b in ix.brokers:
            enq = fmt_cell(ix.get(b, mode, "enqueue", n, size), show_range=False)
            drn = fmt_cell(ix.get(b, mode, "drain", n, size), show_range=False)
            cells.append(f"{enq} / {drn}")
        body.append([str(n), *cells])
    return table(["connections", *(ix.title(b, mode) for b in ix.brokers)], body)


def batched(ix: Index, size: int) -> str:
    body = []
    for b in ix.brokers:
        for mode in MODES:
            enq = ix.get(b, mode, "enqueue", 1, size, "native")
            drn = ix.get(b, mode, "drain", 1, size, "native")
            if enq is None and drn is None:
                continue
            how = str(ix.info.get(b, {}).get("batching", ""))
            body.append([ix.title(b, mode), mode, fmt_cell(enq), fmt_cell(drn), how])
    return table(["broker", "mode", "enqueue msg/s", "drain msg/s", "batching"], body, "llrrl")


def by_payload(ix: Index, mode: Mode, sizes: Sequence[int]) -> str:
    body = []
    for size in sizes:
        cells = []
        for b in ix.brokers:
            enq = fmt_cell(ix.get(b, mode, "enqueue", 1, size), show_range=False)
            drn = fmt_cell(ix.get(b, mode, "drain", 1, size), show_range=False)
            cells.append(f"{enq} / {drn}")
        body.append([_size(size), *cells])
    return table(["payload", *(ix.title(b, mode) for b in ix.brokers)], body)


def _size(size: int) -> str:
    if size % 1024 == 0:
        return f"{size // 1024} KB"
    return f"{size} B"


def per_mode(ix: Index, workload: str, connections: int, size: int) -> str:
    body = []
    for b in ix.brokers:
        cells = [fmt_cell(ix.get(b, m, workload, connections, size)) for m in MODES]
        body.append([ix.title(b), *cells])
    return table(["broker", *(f"{m} msg/s" for m in MODES)], body)


def resources(ix: Index) -> str:
    body = []
    for b in ix.brokers:
        for mode in MODES:
            cells = [
                fmt_cell(ix.get(b, mode, w, None, None))
                for w in ("cpu_seconds", "cpu_per_msg", "peak_rss")
            ]
            if all(c == "-" for c in cells):
                continue
            body.append([ix.title(b, mode), mode, *cells])
    return table(
        ["broker", "mode", "CPU s per repetition", "CPU µs per job", "peak RSS MiB"],
        body,
        "llrrr",
    )


def settings(ix: Index) -> str:
    body = []
    for b in ix.brokers:
        info = ix.info.get(b, {})
        body.append(
            [
                str(info.get("title", b)),
                str(info.get("version", "")),
                str(info.get("client", "")),
                str(info.get("durable", "")),
                str(info.get("buffered", "")),
            ]
        )
    return table(["broker", "version", "client", "durable", "buffered"], body, "lllll")


def published() -> str:
    body = [[q.broker, q.figure, q.value, q.source] for q in PUBLISHED]
    return table(["broker", "figure", "published value", "source"], body, "llrl")


def _has(ix: Index, workload: str) -> bool:
    return any(k.workload == workload for k in ix.by_key)


def render(summary: Summary) -> str:
    m = summary.machine
    run: dict[str, Any] = m.get("run", {})
    ix = Index(summary.rows, m)
    size = _job_bytes(summary.rows)
    conns = sorted(
        {
            k.connections
            for k in ix.by_key
            if k.workload == "enqueue"
            and k.batching == "none"
            and k.payload_bytes == size
            and k.connections is not None
        }
    )
    head_n = HEADLINE_CONNECTIONS if HEADLINE_CONNECTIONS in conns else (max(conns) if conns else 1)
    sizes = sorted(
        {
            k.payload_bytes
            for k in ix.by_key
            if k.workload == "enqueue"
            and k.connections == 1
            and k.batching == "none"
            and k.payload_bytes not in (None, size)
        }
    )
    out: list[str] = ["# Fila beside Redis, NATS JetStream, RabbitMQ and beanstalkd", ""]
    out += _preamble(summary, run)
    for mode in MODES:
        out += [f"## {mode.capitalize()}", "", headline(ix, mode, size, head_n), ""]
    out += [
        "Latency is one connection running sequential enqueue, reserve, ack round trips.",
        "",
    ]
    for mode in MODES:
        out += [
            f"## Throughput against connections, {mode}",
            "",
            "Cells are enqueue / drain jobs/s (medians), one job in flight per connection.",
            "",
            scaling(ix, mode, size, conns),
            "",
        ]
    out += [
        "## Batched: one producer, then one consumer, each client's own batching",
        "",
        batched(ix, size),
        "",
    ]
    if sizes:
        out += ["## Payload size: one connection, one job in flight (enqueue / drain msg/s)", ""]
        for mode in MODES:
            out += [f"{mode.capitalize()}:", "", by_payload(ix, mode, sizes), ""]
    if _has(ix, "lifecycle"):
        out += [
            "## Lifecycle: one producer and one worker at once, 1 KB (enqueue, consume, ack)",
            "",
            per_mode(ix, "lifecycle", 2, 1024),
            "",
        ]
    if _has(ix, "multi_producer"):
        out += [
            "## Three producers at once, 1 KB (enqueue)",
            "",
            per_mode(ix, "multi_producer", 3, 1024),
            "",
        ]
    out += [
        "## Broker resources",
        "",
        "CPU seconds and peak resident memory of each broker's processes (all of them, e.g. "
        "RabbitMQ's beam.smp and epmd) over one repetition of every cell above; CPU per job "
        "divides by the jobs enqueued and consumed in that repetition.",
        "",
        resources(ix),
        "",
        "## Settings",
        "",
        settings(ix),
        "",
    ]
    notes = [
        (b, mode, str(n))
        for b in ix.brokers
        for mode, n in ix.info.get(b, {}).get("notes", {}).items()
        if n
    ]
    for b, mode, note in notes:
        out.append(f"† {ix.title(b)}, {mode}: {note}.")
    if notes:
        out.append("")
    out += [
        "## Not runnable here: published figures",
        "",
        "No registry these machines reach packages Kafka, Faktory, sepp or bunqueue. "
        "Their own published figures are quoted as published, on their hardware and "
        "clients; they are not measurements of this harness and are not comparable "
        "cell by cell.",
        "",
        published(),
        "",
    ]
    out += _failures(summary.rows)
    return "\n".join(out).rstrip() + "\n"


def _preamble(summary: Summary, run: dict[str, Any]) -> list[str]:
    m = summary.machine
    fsync = m.get("fsync_ms", {})
    load = run.get("loadavg", {})
    lines = [
        f"- Commit `{summary.commit[:12]}`, {summary.timestamp}.",
        f"- Command: `{run.get('command', '?')}` ({run.get('profile', '?')} profile, "
        f"{run.get('reps', '?')} repetition(s) per cell; cells show the median with "
        "min-max).",
        f"- Machine: {m.get('cpu', '?')}, {m.get('cpus', '?')} CPUs, "
        f"{m.get('memory_gib', '?')} GiB, {m.get('os', '?')}, kernel {m.get('kernel', '?')}; "
        f"fsync of a 256-byte append p50 {fsync.get('p50', '?')} ms, "
        f"p99 {fsync.get('p99', '?')} ms.",
        f"- Placement: {summary.placement}.",
    ]
    state = str(run.get("state", "complete"))
    if state != "complete":
        lines.append(f"- **Not a complete run** ({state}): brokers missing below were not run.")
    start, end = load.get("start"), load.get("end")
    if run.get("busy"):
        lines.append(
            f"- **Busy machine**: 1-minute load average {start} at start, {end} at end "
            "(other engineers' builds and tests shared both CPUs). Treat differences under "
            "about 30% as noise, and these absolute figures as a floor."
        )
    else:
        lines.append(f"- 1-minute load average {start} at start, {end} at end.")
    failed = [r for r in summary.rows if r.failed]
    measured = [r for r in summary.rows if r.available]
    if failed:
        lines.append(
            f"- **Conservation: {len(failed)} of {len(measured)} rows failed** (marked {WARN}, "
            "listed under Failures)."
        )
    else:
        lines.append(
            f"- Conservation: every one of the {len(measured)} measured rows ended with exact "
            "counts (nothing lost, nothing duplicated, queue empty)."
        )
    lines.append("- `n/a`: not available (see the batching column); `-`: not run.")
    return [*lines, ""]


def _failures(rows: Sequence[Row]) -> list[str]:
    failed = [r for r in rows if r.failed]
    if not failed:
        return []
    out = ["## Failures", ""]
    body = [
        [
            r.broker,
            r.mode,
            r.batching,
            r.workload,
            str(r.connections),
            str(r.payload_bytes),
            r.conservation.replace("|", "/"),
        ]
        for r in failed
    ]
    out.append(
        table(
            ["broker", "mode", "batching", "workload", "conn.", "bytes", "what failed"],
            body,
            "llllrrl",
        )
    )
    return [*out, ""]
