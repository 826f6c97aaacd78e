"""How queues and their stats look, once with totals and, in watch mode, with rates."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from fila.cli.output import numbers_table
from fila.cli.rates import COUNTERS, Rates
from fila_sdk import QueueInfo, QueueStats


def per_second(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def queues_table(queues: list[QueueInfo], rates: dict[str, Rates] | None = None) -> Table:
    """The `queue list` table; with `rates` (watch mode), enqueue/deliver/ack rates."""
    extra = ("enq/s", "deliv/s", "ack/s") if rates is not None else ()
    table = numbers_table("name", "depth", "in-flight", "consumers", *extra)
    for q in queues:
        row = [q.name, str(q.depth), str(q.in_flight), str(q.active_consumers)]
        if rates is not None:
            counters = rates[q.name].counters if q.name in rates else {}
            row += [per_second(counters.get(n)) for n in ("enqueued", "delivered", "acked")]
        table.add_row(*row)
    return table


def queues_json(queues: list[QueueInfo], rates: dict[str, Rates] | None = None) -> list[Any]:
    rows: list[dict[str, Any]] = [asdict(q) for q in queues]
    if rates is not None:
        for row in rows:
            found = rates.get(row["name"])
            row["rates"] = dict(found.counters) if found is not None else None
    return rows


def stats_json(name: str, stats: QueueStats, rates: Rates | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {"name": name, **asdict(stats)}
    if rates is not None:
        data["rates"] = {**rates.counters, "per_key_delivered": rates.per_key}
    return data


def inspect_view(name: str, stats: QueueStats, rates: Rates | None = None) -> RenderableType:
    """Summary, counters (with rates in watch mode), fairness keys and throttle keys."""
    summary = Table.grid(padding=(0, 2))
    for label, value in (
        ("queue", name),
        ("depth", stats.depth),
        ("in-flight", stats.in_flight),
        ("consumers", stats.active_consumers),
        ("fairness keys", stats.active_fairness_keys),
        ("quantum", stats.quantum),
    ):
        summary.add_row(label, str(value))

    counters = numbers_table(
        "since broker start", "total", *(("per second",) if rates else ()), title=None
    )
    for counter in COUNTERS:
        row = [counter.replace("_", "-"), str(getattr(stats, f"{counter}_total"))]
        if rates is not None:
            row.append(per_second(rates.counters.get(counter)))
        counters.add_row(*row)

    key_columns = ["pending", "deficit", "weight", "delivered"]
    if rates is not None:
        key_columns += ["deliv/s", "share"]
    keys = numbers_table("key", *key_columns, title="Fairness keys")
    for k in stats.per_key:
        row = [k.key, str(k.pending_count), str(k.current_deficit), str(k.weight)]
        row.append(str(k.delivered_total))
        if rates is not None:
            row += [per_second(rates.per_key.get(k.key)), percent(rates.share(k.key))]
        keys.add_row(*row)

    throttles = numbers_table("key", "tokens", "rate/s", "burst", title="Throttle keys")
    for t in stats.per_throttle:
        throttles.add_row(t.key, f"{t.tokens:g}", f"{t.rate_per_second:g}", f"{t.burst:g}")
    return Group(
        summary,
        counters,
        keys if stats.per_key else "No active fairness keys.",
        throttles if stats.per_throttle else "No throttle keys.",
    )
