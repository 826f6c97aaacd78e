"""Config page: the broker's runtime config, with set and delete.

The broker validates values (a malformed `throttle.*` is INVALID_ARGUMENT); a refused
change re-renders the form with what the operator typed and the broker's own
message, instead of a redirect that would lose both.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from fila.dashboard.broker import BrokerError
from fila.dashboard.context import of
from fila.dashboard.flash import Flash
from fila.dashboard.render import page


async def _render(
    request: Request,
    *,
    prefix: str = "",
    key: str = "",
    value: str = "",
    error: str = "",
    status_code: int = 200,
) -> Response:
    try:
        listing = await of(request).broker.list_config(prefix)
        entries, total, list_error = list(listing.entries), listing.total_count, ""
    except BrokerError as err:
        entries, total, list_error = [], 0, err.message
    return page(
        request,
        "config.html",
        {
            "prefix": prefix,
            "entries": entries,
            "total": total,
            "list_error": list_error,
            "form_key": key,
            "form_value": value,
            "error": error,
        },
        status_code=status_code,
    )


async def config_page(request: Request) -> Response:
    return await _render(request, prefix=request.query_params.get("prefix", ""))


async def config_set(request: Request) -> Response:
    form = await request.form()
    key = str(form.get("key", "")).strip()
    value = str(form.get("value", ""))
    try:
        await of(request).broker.set_config(key, value)
    except BrokerError as err:
        return await _render(request, key=key, value=value, error=err.message, status_code=422)
    response = RedirectResponse("/config", status_code=303)
    text = f"Set {key} = {value}" if value else f"Deleted {key}"
    of(request).flasher.put(response, Flash("ok", text))
    return response


async def config_delete(request: Request) -> Response:
    """The API has no delete call: an empty value removes the entry (SPEC 2)."""
    form = await request.form()
    key = str(form.get("key", ""))
    try:
        await of(request).broker.set_config(key, "")
    except BrokerError as err:
        return await _render(request, error=err.message, status_code=422)
    response = RedirectResponse("/config", status_code=303)
    of(request).flasher.put(response, Flash("ok", f"Deleted {key}"))
    return response


routes = [
    Route("/config", config_page),
    Route("/config/set", config_set, methods=["POST"]),
    Route("/config/delete", config_delete, methods=["POST"]),
]
