"""The `--auth-token` gate: every request proves it knows the token, or is sent to log in.

Bound to loopback, the dashboard is reachable only from this machine and the token is
optional; bound anywhere else, `fila.dashboard.command` refuses to start without one.
When a token is set it is checked on every request except the login page, static
files and the health probe:

- a browser logs in once with a form; the answer sets an HttpOnly, SameSite=Strict
  cookie holding HMAC(process secret, token), never the token itself, so a leaked
  cookie dies with the process and the token cannot be read back out of it;
- a script may send `Authorization: Bearer <token>` instead.

Both comparisons are constant-time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Final
from urllib.parse import quote

from fila.dashboard.asgi import ASGIApp, Receive, Scope, Send, cookies, header, plain

SESSION_COOKIE: Final = "fila_dashboard_session"
# Paths reachable without a session: what the login page itself needs.
OPEN_PATHS: Final = ("/login", "/healthz")
OPEN_PREFIXES: Final = ("/static/",)


class TokenGate:
    """Knows the token (or that there is none) and what a valid session cookie holds."""

    def __init__(self, token: str | None, secret: bytes) -> None:
        self._token = token.encode() if token else None
        self._session = (
            hmac.new(secret, b"session:" + self._token, hashlib.sha256).hexdigest()
            if self._token
            else ""
        )

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def token_matches(self, presented: str) -> bool:
        return self._token is not None and hmac.compare_digest(self._token, presented.encode())

    @property
    def session_value(self) -> str:
        return self._session

    def admits(self, scope: Scope) -> bool:
        if self._token is None:
            return True
        bearer = header(scope, b"authorization") or ""
        if bearer.startswith("Bearer ") and self.token_matches(bearer[len("Bearer ") :].strip()):
            return True
        cookie = cookies(scope).get(SESSION_COOKIE, "")
        return hmac.compare_digest(cookie.encode(), self._session.encode())


class AuthMiddleware:
    """Refuses (or redirects to the login form) any request the gate does not admit."""

    def __init__(self, app: ASGIApp, gate: TokenGate) -> None:
        self.app = app
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.gate.enabled:
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES) or self.gate.admits(scope):
            await self.app(scope, receive, send)
            return
        if scope["method"] in ("GET", "HEAD") and not path.startswith("/live/"):
            target = path + (f"?{scope['query_string'].decode()}" if scope["query_string"] else "")
            location = "/login?next=" + quote(target, safe="")
            await plain(send, 303, "log in first", [(b"location", location.encode())])
            return
        # Live-refresh fetches and form posts: the script reloads into the login page.
        await plain(send, 401, "authentication required: log in or send the dashboard token")
