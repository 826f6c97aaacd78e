"""API keys page: list, create (the key shown once), revoke, edit ACLs. Superadmins only.

Whether the page works is the broker's decision, asked every time: `ListApiKeys`
succeeds for a superadmin key, is refused (PERMISSION_DENIED / UNAUTHENTICATED)
for any other, and answers UNIMPLEMENTED on a broker without API keys. The page
says which, in those words, rather than guessing from configuration.

A created key is shown in the answer to the POST itself, never stored and never
put in a redirect or a cookie, and the response is marked no-store (as every page).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from fila.dashboard import readonly
from fila.dashboard.broker import BrokerError
from fila.dashboard.context import of
from fila.dashboard.flash import Flash
from fila.dashboard.render import page

ACL_KINDS = ("produce", "consume", "admin")

_MAX_DAYS = 100 * 366  # further than any key needs; keeps the deadline a date


def _unavailable(request: Request, err: BrokerError) -> Response:
    if err.unimplemented:
        reason = "not available on this broker: it does not implement API keys (UNIMPLEMENTED)."
    elif err.unreachable:
        reason = f"the broker is unreachable: {err.message}"
    else:
        reason = f"the dashboard's API key may not manage keys: {err.message}"
    return page(request, "apikeys.html", {"keys": None, "reason": reason})


def _back(request: Request, flash: Flash, url: str = "/apikeys") -> Response:
    response = RedirectResponse(url, status_code=303)
    of(request).flasher.put(response, flash)
    return response


async def apikeys_page(request: Request) -> Response:
    try:
        keys = await of(request).broker.list_api_keys()
    except BrokerError as err:
        return _unavailable(request, err)
    keys.sort(key=lambda k: (k.created_at_ms, k.key_id))
    return page(request, "apikeys.html", {"keys": keys, "reason": ""})


async def create(request: Request) -> Response:
    form = await request.form()
    name = str(form.get("name", "")).strip()
    try:
        days = float(str(form.get("expires_days", "") or "0"))
    except ValueError:
        return _back(request, Flash("error", "Expiry must be a number of days (0 = never)."))
    if not 0 <= days <= _MAX_DAYS:  # also refuses nan and inf
        return _back(request, Flash("error", "Expiry must be a number of days (0 = never)."))
    expires_at_ms = int(time.time() * 1000 + days * 86_400_000) if days else 0
    superadmin = form.get("superadmin") == "yes"
    try:
        created = await of(request).broker.create_api_key(
            name, expires_at_ms=expires_at_ms, is_superadmin=superadmin
        )
    except BrokerError as err:
        return _back(request, Flash("error", f"Key not created: {err.message}"))
    return page(request, "apikey_created.html", {"created": created, "name": name})


async def confirm_revoke(request: Request) -> Response:
    if of(request).read_only:
        return readonly.refused(request)
    key_id = request.path_params["key_id"]
    return page(
        request,
        "confirm.html",
        {
            "question": f"Revoke API key “{key_id}”? Clients using it are refused at once.",
            "action_url": f"/apikeys/{key_id}/revoke",
            "fields": {},
            "label": "Revoke",
            "cancel_url": "/apikeys",
        },
    )


async def revoke(request: Request) -> Response:
    key_id = request.path_params["key_id"]
    form = await request.form()
    if form.get("confirmed") != "yes":
        return _back(request, Flash("error", "Revocation not confirmed."))
    try:
        await of(request).broker.revoke_api_key(key_id)
    except BrokerError as err:
        return _back(request, Flash("error", f"Key not revoked: {err.message}"))
    return _back(request, Flash("ok", f"Revoked key {key_id}."))


def parse_acl(text: str) -> tuple[list[tuple[str, str]], str]:
    """Lines of `kind pattern` -> permissions, or an error naming the bad line."""
    permissions: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            return [], f"line {number}: expected “kind pattern”, e.g. “consume orders.*”"
        permissions.append((parts[0], parts[1]))
    return permissions, ""


async def _acl_page(
    request: Request, key_id: str, *, text: str | None = None, error: str = "", status: int = 200
) -> Response:
    try:
        acl = await of(request).broker.get_acl(key_id)
    except BrokerError as err:
        if err.unimplemented or err.unreachable:
            return _unavailable(request, err)
        return page(
            request, "acl.html", {"key_id": key_id, "acl": None, "text": "", "error": err.message}
        )
    if text is None:
        text = "\n".join(f"{p.kind} {p.pattern}" for p in acl.permissions)
    return page(
        request,
        "acl.html",
        {"key_id": key_id, "acl": acl, "text": text, "error": error, "kinds": ACL_KINDS},
        status_code=status,
    )


async def acl_page(request: Request) -> Response:
    return await _acl_page(request, request.path_params["key_id"])


async def acl_set(request: Request) -> Response:
    key_id = request.path_params["key_id"]
    form = await request.form()
    text = str(form.get("permissions", ""))
    permissions, error = parse_acl(text)
    if error:
        return await _acl_page(request, key_id, text=text, error=error, status=422)
    try:
        await of(request).broker.set_acl(key_id, permissions)
    except BrokerError as err:
        return await _acl_page(request, key_id, text=text, error=err.message, status=422)
    return _back(request, Flash("ok", f"ACL of {key_id} saved."), f"/apikeys/{key_id}/acl")


routes = [
    Route("/apikeys", apikeys_page),
    Route("/apikeys/create", create, methods=["POST"]),
    Route("/apikeys/{key_id:str}/confirm-revoke", confirm_revoke),
    Route("/apikeys/{key_id:str}/revoke", revoke, methods=["POST"]),
    Route("/apikeys/{key_id:str}/acl", acl_page),
    Route("/apikeys/{key_id:str}/acl", acl_set, methods=["POST"]),
]
