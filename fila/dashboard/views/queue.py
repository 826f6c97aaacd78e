"""Queue page: fairness keys with delivery shares against weight shares, throttles, charts,
hook errors, the queue's configuration from `GetQueue`, and a paged message browser over
`PeekMessages` (which leases and changes nothing)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from fila.dashboard.broker import BrokerError
from fila.dashboard.charts import Chart, line_chart, span_for
from fila.dashboard.context import of
from fila.dashboard.history import (
    RATE_WINDOW_S,
    SHARE_WINDOW_S,
    KeyShare,
    QueueHistory,
    QueueSample,
    Rates,
)
from fila.dashboard.queue_form import attempts_text
from fila.dashboard.render import fragment, page
from fila.dashboard.sampler import Sampler
from fila.v1 import admin_pb2, messages_pb2
from fila.wire import dlq_name, dlq_owner

PAGE_SIZE: Final = 20
# The broker lists up to 1,000 active keys; a page shows the most backlogged ones.
MAX_KEY_ROWS: Final = 100


@dataclass(frozen=True, slots=True)
class QueueView:
    name: str
    latest: QueueSample
    rates: Rates | None
    shares: list[KeyShare]
    hidden_keys: int
    charts: tuple[Chart, Chart]
    dlq: str | None
    parent: str | None  # the queue this one is the DLQ of, by name
    parent_listed: bool


@dataclass(frozen=True, slots=True)
class Browser:
    """One page of `PeekMessages` (each message with its state, None from a broker that
    does not report states), or the broker's reason for refusing it."""

    rows: list[tuple[messages_pb2.Message, admin_pb2.PeekedState | None]]
    next_after: str
    key: str
    after: str
    error: str

    @property
    def failed(self) -> bool:
        """Some message on the page has failed before (its last error is shown)."""
        return any(m.metadata.last_error for m, _ in self.rows)


@dataclass(frozen=True, slots=True)
class Settings:
    """A queue's configuration from `GetQueue`, or the broker's reason for refusing it."""

    config: admin_pb2.QueueConfig | None
    is_dlq: bool
    error: str

    @property
    def max_attempts(self) -> str:
        return attempts_text(self.config.max_attempts) if self.config else ""


def charts(history: QueueHistory, retention: float) -> tuple[Chart, Chart]:
    now = time.monotonic()
    samples = list(history.samples)
    span = span_for(now - samples[0].at if samples else 0.0, retention)
    depth = line_chart(
        "Depth and in flight",
        "messages",
        now,
        span,
        [
            ("depth", "s-depth", [(s.at, float(s.depth)) for s in samples]),
            ("in flight", "s-inflight", [(s.at, float(s.in_flight)) for s in samples]),
        ],
    )
    points = history.rate_series()
    rates = line_chart(
        "Rates",
        "messages/s",
        now,
        span,
        [
            ("enqueued", "s-enq", [(p.at, p.enqueued) for p in points]),
            ("delivered", "s-deliv", [(p.at, p.delivered) for p in points]),
            ("acked", "s-ack", [(p.at, p.acked) for p in points]),
        ],
    )
    return depth, rates


def queue_view(sampler: Sampler, name: str) -> QueueView | None:
    history = sampler.history(name)
    latest = history.latest if history else None
    if history is None or latest is None:
        return None
    shares = history.key_shares(SHARE_WINDOW_S)
    shown = sorted(shares, key=lambda s: (-s.pending, s.key))[:MAX_KEY_ROWS]
    listed = set(sampler.snapshot.queues)
    return QueueView(
        name=name,
        latest=latest,
        rates=history.rates(RATE_WINDOW_S),
        shares=sorted(shown, key=lambda s: s.key),
        hidden_keys=max(0, latest.active_keys - len([s for s in shown if s.active])),
        charts=charts(history, sampler.retention),
        dlq=dlq_name(name) if dlq_name(name) in listed else None,
        parent=dlq_owner(name),
        parent_listed=dlq_owner(name) in listed,
    )


async def known_view(request: Request, name: str) -> QueueView | None:
    """The queue's view; samples once more if the queue is new since the last sample."""
    sampler = of(request).sampler
    view = queue_view(sampler, name)
    if view is None:
        await sampler.sample()
        view = queue_view(sampler, name)
    return view


async def browse(
    request: Request,
    queue: str,
    *,
    state: admin_pb2.MessageState.ValueType = admin_pb2.MESSAGE_STATE_UNSPECIFIED,
    after_param: str = "after",
) -> Browser:
    """The page of messages the query asks for (`key`, and `after_param` for paging);
    only those in `state` when it is set."""
    key = request.query_params.get("key", "")
    after = request.query_params.get(after_param, "")
    try:
        reply = await of(request).broker.peek(
            queue, limit=PAGE_SIZE, after_id=after, fairness_key=key, state=state
        )
    except BrokerError as err:
        return Browser([], "", key, after, err.message)
    states: list[admin_pb2.PeekedState | None] = list(reply.states)
    if len(states) != len(reply.messages):
        states = [None] * len(reply.messages)
    return Browser(
        list(zip(reply.messages, states, strict=True)), reply.next_after_id, key, after, ""
    )


async def settings(request: Request, queue: str) -> Settings:
    try:
        reply = await of(request).broker.get_queue(queue)
    except BrokerError as err:
        return Settings(None, dlq_owner(queue) is not None, err.message)
    return Settings(reply.config, not reply.dlq, "")


def not_found(request: Request, name: str) -> Response:
    snapshot = of(request).sampler.snapshot
    reason = (
        f"The broker did not answer ({snapshot.status.error}), so queue “{name}” cannot be shown."
        if not snapshot.status.ok
        else f"The broker does not list a queue named “{name}” (or this dashboard's key may "
        "not see it)."
    )
    return page(request, "missing.html", {"name": name, "reason": reason}, status_code=404)


async def queue_page(request: Request) -> Response:
    name = request.path_params["name"]
    view = await known_view(request, name)
    if view is None:
        return not_found(request, name)
    context = {
        "q": view,
        "settings": await settings(request, name),
        "browser": await browse(request, name),
    }
    return page(request, "queue.html", context)


async def queue_live(request: Request) -> Response:
    name = request.path_params["name"]
    return fragment(request, "_queue_live.html", {"q": queue_view(of(request).sampler, name)})


routes = [
    Route("/queues/{name:str}", queue_page),
    Route("/live/queues/{name:str}", queue_live),
]
