"""Security headers on every response, and the Host check that stops DNS rebinding.

The CSP allows scripts, styles and fetches from this origin only and no inline
script or style at all, so even a rendering bug that let message content through
as markup could not run it; charts and bars are SVG attributes, not style
attributes, for the same reason. Pages hold broker data and are never cached.

Bound to loopback without a token, the only thing standing between a web page the
operator visits and the dashboard is the browser's same-origin policy, which a DNS
rebinding attack (evil.example resolving to 127.0.0.1) defeats. Such requests carry
the attacker's host name in `Host`, so on loopback only loopback names are served.
"""

from __future__ import annotations

from typing import Final

from fila.dashboard.asgi import ASGIApp, Message, Receive, Scope, Send, header, plain

CONTENT_SECURITY_POLICY: Final = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)

SECURITY_HEADERS: Final = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"permissions-policy", b"camera=(), microphone=(), geolocation=(), interest-cohort=()"),
)

LOOPBACK_NAMES: Final = ("localhost", "127.0.0.1", "[::1]")


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = list(SECURITY_HEADERS)
                if not static:
                    extra.append((b"cache-control", b"no-store"))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class LoopbackHostMiddleware:
    """Serves only requests whose Host names this machine's loopback (see module doc)."""

    def __init__(self, app: ASGIApp, port: int) -> None:
        self.app = app
        self.allowed = {f"{name}:{port}" for name in LOOPBACK_NAMES} | set(LOOPBACK_NAMES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (header(scope, b"host") or "") not in self.allowed:
            await plain(send, 421, "unexpected Host header: open the dashboard on localhost")
            return
        await self.app(scope, receive, send)
