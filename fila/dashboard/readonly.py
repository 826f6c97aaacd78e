"""The read-only dashboard: what it is without `--auth-token`, and how it refuses changes.

On loopback a token is optional, but without one every process on the machine that
can open a TCP connection acts with the dashboard's API key, which is often the
broker's superadmin (bootstrap) key: it could create itself a superadmin key, purge
a queue or change the config, and CSRF tokens do not stop a local process (it reads
a page and posts the token back). So without a token the dashboard only shows: it
refuses every state-changing request (any method but GET, HEAD and OPTIONS: API
keys, ACLs, config, queue settings, redrive, purge, and whatever form is added
later) with a 403 page that says why and how to enable changes, disables the
buttons that would be refused, and says so in a banner on every page.
`--auth-token` (changes by those who hold it) or `--allow-writes-on-loopback`
(changes by anyone local, as before) turns writes on
(`fila.dashboard.app.Settings.read_only`).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from fila.dashboard.asgi import ASGIApp, Receive, Scope, Send
from fila.dashboard.csrf import SAFE_METHODS
from fila.dashboard.render import page


def refused(request: Request) -> Response:
    """The 403 page for an action a read-only dashboard does not take (also used by
    the GET confirmation pages, the first step of one)."""
    return page(request, "read_only.html", {}, status_code=403)


class ReadOnlyMiddleware:
    """Refuses every state-changing request before it reaches a route.

    It runs inside the Starlette app (after the CSRF check, which has already read
    the body), where the request reaches the dashboard's state and the refusal is
    rendered as a page of the dashboard."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
            await refused(Request(scope, receive))(scope, receive, send)
            return
        await self.app(scope, receive, send)
