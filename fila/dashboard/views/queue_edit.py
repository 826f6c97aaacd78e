"""Queue settings editor: a queue's configuration in a form, saved with `UpdateQueue`.

Only the fields the operator changed are sent (see `fila.dashboard.queue_form`). The
broker checks everything, scripts compiled included, before it changes anything: a
refused update re-renders the form with what was typed and the broker's own message,
and the queue is as it was. A read-only dashboard refuses the page itself as well as
the POST (the page is the first step of a change, as the confirmation pages are).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from fila.dashboard import readonly
from fila.dashboard.broker import BrokerError
from fila.dashboard.context import of
from fila.dashboard.flash import Flash
from fila.dashboard.queue_form import (
    DLQ_FIELDS,
    FIELDS,
    LABELS,
    SCRIPTS,
    SHOWN_PREFIX,
    changes,
    digests,
    shown_values,
)
from fila.dashboard.render import page


def _form(
    request: Request,
    name: str,
    *,
    values: Mapping[str, str],
    shown: Mapping[str, str],
    error: str = "",
    status_code: int = 200,
) -> Response:
    return page(
        request,
        "queue_edit.html",
        {
            "name": name,
            "fields": [f for f in FIELDS if f in values],
            "values": values,
            "shown": shown,
            "labels": LABELS,
            "scripts": SCRIPTS,
            "shown_prefix": SHOWN_PREFIX,
            "error": error,
        },
        status_code=status_code,
    )


async def edit_page(request: Request) -> Response:
    if of(request).read_only:
        return readonly.refused(request)
    name = request.path_params["name"]
    try:
        reply = await of(request).broker.get_queue(name)
    except BrokerError as err:
        reason = f"The broker did not give queue “{name}”'s configuration: {err.message}"
        return page(request, "missing.html", {"name": name, "reason": reason}, status_code=404)
    values = shown_values(reply.config)
    fields: Sequence[str] = FIELDS if reply.dlq else DLQ_FIELDS
    values = {f: values[f] for f in fields}
    return _form(request, name, values=values, shown=digests(values))


async def edit(request: Request) -> Response:
    name = request.path_params["name"]
    form = await request.form()
    submitted = {f: str(form[f]) for f in FIELDS if f in form}
    shown = {f: str(form.get(SHOWN_PREFIX + f, "")) for f in submitted}

    def again(error: str) -> Response:
        return _form(request, name, values=submitted, shown=shown, error=error, status_code=422)

    try:
        wanted = changes(submitted, shown)
    except ValueError as err:
        return again(f"Nothing was sent to the broker. {err}")
    changed = wanted.names()
    response = RedirectResponse(f"/queues/{name}", status_code=303)
    if not changed:
        of(request).flasher.put(response, Flash("ok", "No setting was changed."))
        return response
    try:
        await of(request).broker.update_queue(
            name,
            on_enqueue=wanted.on_enqueue,
            on_failure=wanted.on_failure,
            visibility_timeout_ms=wanted.visibility_timeout_ms,
            max_attempts=wanted.max_attempts,
            retry_backoff=wanted.retry_backoff,
        )
    except BrokerError as err:
        return again(f"The broker refused the change, and nothing was changed: {err.message}")
    text = f"Updated “{name}”: {', '.join(changed)}."
    of(request).flasher.put(response, Flash("ok", text))
    return response


routes = [
    Route("/queues/{name:str}/edit", edit_page),
    Route("/queues/{name:str}/edit", edit, methods=["POST"]),
]
