"""Small helpers for the dashboard's pure-ASGI middlewares.

The security layers (host check, token gate, CSRF, headers) are plain ASGI
middlewares rather than Starlette's `BaseHTTPMiddleware`: they must see every
request, including static files and errors, and the CSRF check has to read the
request body and hand it on unchanged, which only works at this level.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.requests import cookie_parser

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of request header `name` (lower-case bytes), decoded as latin-1."""
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def cookies(scope: Scope) -> dict[str, str]:
    """The request's cookies, parsed as Starlette's `Request.cookies` does."""
    raw = header(scope, b"cookie")
    return cookie_parser(raw) if raw else {}


def state(scope: Scope) -> dict[str, Any]:
    """Starlette's `request.state` storage: what middlewares pass on to the routes."""
    store: dict[str, Any] = scope.setdefault("state", {})
    return store


async def plain(
    send: Send, status: int, text: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """Answer with a short text/plain body (refusals from the middlewares)."""
    body = text.encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def set_cookie(name: str, value: str, *, max_age: int | None = None) -> tuple[bytes, bytes]:
    """A Set-Cookie header the browser keeps to this site and hides from scripts."""
    parts = [f"{name}={value}", "Path=/", "HttpOnly", "SameSite=Strict"]
    if max_age is not None:
        parts.append(f"Max-Age={max_age}")
    return (b"set-cookie", "; ".join(parts).encode("latin-1"))
