"""Cross-site request forgery: no state-changing request without a token only our pages hold.

Signed double-submit: each browser gets a random, HttpOnly `fila_dashboard_csrf`
cookie; every form carries `csrf_token` = HMAC(process secret, that cookie). A
forged cross-site POST may make the browser send the cookie, but its page can read
neither the cookie nor our pages, so it cannot produce the matching field; the
SameSite=Strict cookie and the Origin check below are further walls, not the main one.

The check sits in one middleware in front of every route: any method other than
GET/HEAD/OPTIONS is refused with 403 unless the token matches, so a new form
handler cannot forget it. The middleware reads the (small, url-encoded) body to
find the field and hands the same bytes on to the route.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final
from urllib.parse import parse_qs, urlsplit

from fila.dashboard.asgi import (
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    cookies,
    header,
    plain,
    set_cookie,
    state,
)

CSRF_COOKIE: Final = "fila_dashboard_csrf"
CSRF_FIELD: Final = "csrf_token"
CSRF_HEADER: Final = b"x-csrf-token"
SAFE_METHODS: Final = ("GET", "HEAD", "OPTIONS")
# The largest form here is a queue's settings: two Lua scripts of at most 256 KiB
# each on the broker, URL-encoded (up to 3 bytes per byte); anything bigger is not ours.
MAX_BODY_BYTES: Final = 2 * 1024 * 1024


class CsrfTokens:
    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def token_for(self, cookie: str) -> str:
        return hmac.new(self._secret, b"csrf:" + cookie.encode(), hashlib.sha256).hexdigest()

    def valid(self, cookie: str, presented: str) -> bool:
        return bool(cookie) and hmac.compare_digest(
            self.token_for(cookie).encode(), presented.encode()
        )


class CsrfMiddleware:
    """Issues the cookie, exposes the form token to templates, checks unsafe methods."""

    def __init__(self, app: ASGIApp, tokens: CsrfTokens) -> None:
        self.app = app
        self.tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cookie = cookies(scope).get(CSRF_COOKIE, "")
        fresh = not cookie
        if fresh:
            cookie = secrets.token_urlsafe(32)
        state(scope)["csrf_token"] = self.tokens.token_for(cookie)

        if scope["method"] not in SAFE_METHODS:
            body, refusal = await _read_body(receive)
            if refusal is None:
                refusal = self._refusal(scope, cookie if not fresh else "", body)
            if refusal is not None:
                await plain(send, 403, refusal)
                return
            receive = _replay(body, receive)

        async def send_with_cookie(message: Message) -> None:
            if fresh and message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], set_cookie(CSRF_COOKIE, cookie)]
            await send(message)

        await self.app(scope, receive, send_with_cookie)

    def _refusal(self, scope: Scope, cookie: str, body: bytes) -> str | None:
        origin = header(scope, b"origin")
        host = header(scope, b"host")
        if origin and origin != "null" and urlsplit(origin).netloc != host:
            return "cross-site request refused (Origin does not match Host)"
        presented = header(scope, CSRF_HEADER)
        if presented is None:
            content_type = header(scope, b"content-type") or ""
            if not content_type.startswith("application/x-www-form-urlencoded"):
                return "CSRF token missing: submit the dashboard's own form"
            fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=200)
            presented = (fields.get(CSRF_FIELD) or [""])[0]
        if not self.tokens.valid(cookie, presented):
            return "CSRF token missing or invalid: reload the page and try again"
        return None


async def _read_body(receive: Receive) -> tuple[bytes, str | None]:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", "client went away"
        chunk = bytes(message.get("body", b""))
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return b"", f"request body over {MAX_BODY_BYTES} bytes"
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _replay(body: bytes, then: Receive) -> Receive:
    """Hands the already-read body to the app, then the client's own events (disconnect)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await then()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive
