"""Overview: every queue at a glance, refreshed live; plus the status banner and health probe."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from fila.dashboard.context import of
from fila.dashboard.history import RATE_WINDOW_S, Rates
from fila.dashboard.render import fragment, page
from fila.dashboard.sampler import Sampler
from fila.wire import dlq_name, dlq_owner


@dataclass(frozen=True, slots=True)
class QueueRow:
    name: str
    depth: int
    in_flight: int
    consumers: int
    dlq: str | None
    dlq_depth: int | None
    rates: Rates | None
    stats_error: str
    leader: int = 0  # cluster mode: the node leading the queue
    in_sync: str = ""  # a replicated queue's in-sync replicas, as "2/3"


def queue_rows(sampler: Sampler) -> list[QueueRow]:
    """One row per queue; a DLQ is folded into its parent's row when the parent is listed."""
    names = sampler.snapshot.queues
    listed = set(names)
    rows: list[QueueRow] = []
    for name in names:
        parent = dlq_owner(name)
        if parent is not None and parent in listed:
            continue
        history = sampler.history(name)
        latest = history.latest if history else None
        if history is None or latest is None:
            continue
        dlq = dlq_name(name) if dlq_name(name) in listed else None
        dlq_history = sampler.history(dlq) if dlq else None
        dlq_latest = dlq_history.latest if dlq_history else None
        rows.append(
            QueueRow(
                name=name,
                depth=latest.depth,
                in_flight=latest.in_flight,
                consumers=latest.consumers,
                dlq=dlq,
                dlq_depth=dlq_latest.depth if dlq_latest else None,
                rates=history.rates(RATE_WINDOW_S),
                stats_error=latest.stats_error,
                leader=latest.leader,
                in_sync=(
                    f"{len(latest.in_sync)}/{len(latest.replicas)}"
                    if len(latest.replicas) > 1
                    else ""
                ),
            )
        )
    return rows


async def overview(request: Request) -> Response:
    return page(request, "overview.html", {"rows": queue_rows(of(request).sampler)})


async def overview_live(request: Request) -> Response:
    return fragment(request, "_overview.html", {"rows": queue_rows(of(request).sampler)})


async def status_live(request: Request) -> Response:
    return fragment(request, "_banner.html", {})


async def healthz(request: Request) -> Response:
    """For supervisors: the dashboard itself is up (the broker may not be)."""
    return PlainTextResponse("ok")


routes = [
    Route("/", overview),
    Route("/live/overview", overview_live),
    Route("/live/status", status_live),
    Route("/healthz", healthz),
]
