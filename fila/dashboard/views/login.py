"""Login and logout for `--auth-token` (see `fila.dashboard.auth`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from fila.dashboard.auth import SESSION_COOKIE
from fila.dashboard.context import of
from fila.dashboard.render import page


def _local(target: str) -> str:
    """Only paths on this site: a login link must not bounce the operator elsewhere."""
    if target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/"


async def login_page(request: Request) -> Response:
    if not of(request).gate.enabled:
        return RedirectResponse("/", status_code=303)
    next_url = _local(request.query_params.get("next", "/"))
    return page(request, "login.html", {"next_url": next_url, "error": ""})


async def login(request: Request) -> Response:
    gate = of(request).gate
    form = await request.form()
    next_url = _local(str(form.get("next", "/")))
    if not gate.token_matches(str(form.get("token", ""))):
        return page(
            request,
            "login.html",
            {"next_url": next_url, "error": "Wrong token."},
            status_code=401,
        )
    response = RedirectResponse(next_url, status_code=303)
    response.set_cookie(SESSION_COOKIE, gate.session_value, httponly=True, samesite="strict")
    return response


async def logout(request: Request) -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict")
    return response


routes = [
    Route("/login", login_page),
    Route("/login", login, methods=["POST"]),
    Route("/logout", logout, methods=["POST"]),
]
