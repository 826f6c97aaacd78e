"""DLQ page: browse dead letters, redrive some or all, purge; every action confirmed first.

Confirmation is a page of its own (GET) holding the real POST form, rather than a
script `confirm()`: it works without JavaScript, states exactly what will happen
(how many, from where, to where), and a POST without `confirmed=yes` is refused, so
no single click or forged form skips the question.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from fila.dashboard import readonly
from fila.dashboard.broker import BrokerError
from fila.dashboard.context import of
from fila.dashboard.flash import Flash
from fila.dashboard.render import fragment, page
from fila.dashboard.views.queue import browse, known_view, not_found, queue_view
from fila.wire import dlq_owner

_MAX_COUNT = 2**64 - 1  # the wire's uint64


def _count(raw: str | None) -> int | None:
    """A redrive count: 0 means all; None for anything that is not a whole number from 0
    to the wire's largest."""
    try:
        value = int(raw or "0")
    except ValueError:
        return None
    return value if 0 <= value <= _MAX_COUNT else None


def _not_a_dlq(request: Request, name: str) -> Response | None:
    """A 404 for a name that is not a dead-letter queue (a live queue's messages are not
    for redriving, and its purge belongs on its own page); None for a DLQ's name."""
    if dlq_owner(name) is not None:
        return None
    reason = (
        f"“{name}” is not a dead-letter queue: those are named after their queue with "
        f"“.dlq” at the end. The queue's own page is /queues/{name}."
    )
    return page(request, "missing.html", {"name": name, "reason": reason}, status_code=404)


def _back(request: Request, name: str, flash: Flash) -> Response:
    response = RedirectResponse(f"/dlq/{name}", status_code=303)
    of(request).flasher.put(response, flash)
    return response


async def dlq_page(request: Request) -> Response:
    name = request.path_params["name"]
    if dlq_owner(name) is None:
        return RedirectResponse(f"/queues/{name}", status_code=303)
    view = await known_view(request, name)
    if view is None:
        return not_found(request, name)
    return page(
        request,
        "dlq.html",
        {"q": view, "target": dlq_owner(name), "browser": await browse(request, name)},
    )


async def dlq_live(request: Request) -> Response:
    name = request.path_params["name"]
    return fragment(request, "_dlq_live.html", {"q": queue_view(of(request).sampler, name)})


async def confirm(request: Request) -> Response:
    if of(request).read_only:
        return readonly.refused(request)
    name = request.path_params["name"]
    action = request.path_params["action"]
    if (refused := _not_a_dlq(request, name)) is not None:
        return refused
    view = await known_view(request, name)
    if view is None:
        return not_found(request, name)
    target = dlq_owner(name)
    if action == "redrive":
        count = _count(request.query_params.get("count"))
        if count is None:
            return _back(request, name, Flash("error", "Redrive count must be a whole number ≥ 0."))
        how_many = "all" if count == 0 else f"up to {count}"
        question = (
            f"Move {how_many} of the {view.latest.depth} ready message(s) in “{name}” back "
            f"to “{target}”? Their attempt counts restart at 0 and on_enqueue runs again."
        )
        fields = {"count": str(count)}
        label = "Redrive"
    elif action == "purge":
        question = (
            f"Delete every ready message in “{name}” ({view.latest.depth} now)? Leased ones "
            "are left to finish. This cannot be undone."
        )
        fields = {}
        label = "Purge"
    else:
        return not_found(request, f"{name}/{action}")
    return page(
        request,
        "confirm.html",
        {
            "question": question,
            "action_url": f"/dlq/{name}/{action}",
            "fields": fields,
            "label": label,
            "cancel_url": f"/dlq/{name}",
        },
    )


async def redrive(request: Request) -> Response:
    name = request.path_params["name"]
    if (refused := _not_a_dlq(request, name)) is not None:
        return refused
    form = await request.form()
    count = _count(str(form.get("count", "")))
    if form.get("confirmed") != "yes" or count is None:
        return _back(request, name, Flash("error", "Redrive not confirmed; nothing was moved."))
    dash = of(request)
    try:
        moved = await dash.broker.redrive(name, count)
    except BrokerError as err:
        return _back(request, name, Flash("error", f"Redrive refused by the broker: {err.message}"))
    await dash.sampler.sample()
    target = dlq_owner(name)
    return _back(
        request, name, Flash("ok", f"Redrove {moved} message(s) from “{name}” to “{target}”.")
    )


async def purge(request: Request) -> Response:
    name = request.path_params["name"]
    if (refused := _not_a_dlq(request, name)) is not None:
        return refused
    form = await request.form()
    if form.get("confirmed") != "yes":
        return _back(request, name, Flash("error", "Purge not confirmed; nothing was deleted."))
    dash = of(request)
    try:
        purged = await dash.broker.purge(name)
    except BrokerError as err:
        return _back(request, name, Flash("error", f"Purge refused by the broker: {err.message}"))
    await dash.sampler.sample()
    return _back(request, name, Flash("ok", f"Purged {purged} message(s) from “{name}”."))


routes = [
    Route("/dlq/{name:str}", dlq_page),
    Route("/live/dlq/{name:str}", dlq_live),
    Route("/dlq/{name:str}/confirm/{action:str}", confirm),
    Route("/dlq/{name:str}/redrive", redrive, methods=["POST"]),
    Route("/dlq/{name:str}/purge", purge, methods=["POST"]),
]
