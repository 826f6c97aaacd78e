"""How queues and their stats look, once with totals and, in watch mode, with rates.

In cluster mode (SPEC 9) every queue lives on one node, its leader: `places` maps
queue names to where they live, and a `node` column (a `node` key in JSON) appears
only when some queue has a node, so single-node output is exactly what it always
was. Replicated queues add their replicas and in-sync set (`replicas`, `in sync`;
`replicas` and `in_sync` keys in JSON) the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table

from fila.cli.durations import format_ms
from fila.cli.output import numbers_table
from fila.cli.rates import COUNTERS, Rates
from fila.cli.raw import Place
from fila_sdk import QueueDetails, QueueInfo, QueueStats


def per_second(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def queues_table(
    queues: list[QueueInfo],
    rates: dict[str, Rates] | None = None,
    places: Mapping[str, Place] | None = None,
) -> Table:
    """The `queue list` table; with `rates` (watch mode), enqueue/deliver/ack rates;
    with `places` (cluster mode), each queue's node, and replicas when replicated."""
    clustered = _clustered(places)
    replicated = _replicated(places)
    extra = ("enq/s", "deliv/s", "ack/s") if rates is not None else ()
    where = ("node", *(("replicas", "in sync") if replicated else ())) if clustered else ()
    table = numbers_table("name", *where, "depth", "in-flight", "consumers", *extra)
    for q in queues:
        row = [q.name]
        if places is not None and clustered:
            place = places.get(q.name, Place())
            row.append(str(place.node or "-"))
            if replicated:
                row += [_ids(place.replicas), _in_sync(place)]
        row += [str(q.depth), str(q.in_flight), str(q.active_consumers)]
        if rates is not None:
            counters = rates[q.name].counters if q.name in rates else {}
            row += [per_second(counters.get(n)) for n in ("enqueued", "delivered", "acked")]
        table.add_row(*row)
    return table


def queues_json(
    queues: list[QueueInfo],
    rates: dict[str, Rates] | None = None,
    places: Mapping[str, Place] | None = None,
) -> list[Any]:
    rows: list[dict[str, Any]] = [asdict(q) for q in queues]
    if places is not None and _clustered(places):
        for row in rows:
            row.update(_place_json(places.get(row["name"], Place())))
    if rates is not None:
        for row in rows:
            found = rates.get(row["name"])
            row["rates"] = dict(found.counters) if found is not None else None
    return rows


def _clustered(places: Mapping[str, Place] | None) -> bool:
    return places is not None and any(place.node for place in places.values())


def _replicated(places: Mapping[str, Place] | None) -> bool:
    return places is not None and any(place.replicated for place in places.values())


def _ids(nodes: tuple[int, ...]) -> str:
    return ",".join(str(n) for n in nodes) or "-"


def _in_sync(place: Place) -> str:
    if not place.replicated:
        return "-"
    return f"{len(place.in_sync)}/{len(place.replicas)}"


def _place_json(place: Place) -> dict[str, Any]:
    data: dict[str, Any] = {"node": place.node}
    if place.replicated:
        data.update(replicas=list(place.replicas), in_sync=list(place.in_sync))
    return data


def stats_json(
    name: str, stats: QueueStats, rates: Rates | None = None, place: Place | None = None
) -> dict[str, Any]:
    where = _place_json(place) if place is not None and place.node else {}
    data: dict[str, Any] = {"name": name, **where, **asdict(stats)}
    if rates is not None:
        data["rates"] = {**rates.counters, "per_key_delivered": rates.per_key}
    return data


def inspect_view(
    name: str, stats: QueueStats, rates: Rates | None = None, place: Place | None = None
) -> RenderableType:
    """Summary (with the queue's node in cluster mode, and its replicas when it is
    replicated), counters (with rates in watch mode), fairness keys and throttle keys."""
    where: list[tuple[str, object]] = []
    if place is not None and place.node:
        where.append(("node", place.node))
        if place.replicated:
            where.append(("replicas", f"{_ids(place.replicas)} (leader first)"))
            where.append(("in sync", f"{_ids(place.in_sync)} ({_in_sync(place)})"))
    summary = Table.grid(padding=(0, 2))
    for label, value in (
        ("queue", name),
        *where,
        ("depth", f"{stats.depth} (ready {stats.ready}, delayed {stats.delayed})"),
        ("in-flight", f"{stats.in_flight} (leased)"),
        ("consumers", stats.active_consumers),
        ("fairness keys", stats.active_fairness_keys),
        ("quantum", stats.quantum),
        *(
            (("hook errors", f"{stats.hook_errors_total}, last: {stats.last_hook_error}"),)
            if stats.hook_errors_total
            else ()
        ),
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


def queue_config_json(details: QueueDetails) -> dict[str, Any]:
    config = details.config
    return {
        "name": details.name,
        "dlq": details.dlq,
        "on_enqueue_script": config.on_enqueue,
        "on_failure_script": config.on_failure,
        "visibility_timeout_ms": config.visibility_timeout_ms,
        "max_attempts": config.max_attempts,  # null: no limit
        "retry_backoff": config.retry_backoff,
    }


def queue_config_view(details: QueueDetails) -> RenderableType:
    """`queue show`: one line per setting, then the scripts."""
    config = details.config
    summary = Table.grid(padding=(0, 2))
    hooked = bool(config.on_failure)
    retry = "decided by on_failure" if hooked else config.retry_backoff
    attempts = "unlimited" if config.max_attempts is None else str(config.max_attempts)
    for label, value in (
        ("queue", details.name),
        ("dead letters", details.dlq or "- (this is a dead-letter queue)"),
        ("visibility timeout", format_ms(config.visibility_timeout_ms)),
        ("retry backoff", retry),
        ("max attempts", "decided by on_failure" if hooked else attempts),
        ("on_enqueue", "yes" if config.on_enqueue else "none"),
        ("on_failure", "yes" if config.on_failure else "none"),
    ):
        summary.add_row(label, value)
    parts: list[RenderableType] = [summary]
    for hook, source in (("on_enqueue", config.on_enqueue), ("on_failure", config.on_failure)):
        if source:
            parts += [f"-- {hook} --", source.rstrip()]
    return Group(*parts)
