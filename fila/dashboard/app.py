"""Assembles the dashboard: routes, static files, security layers, and the sampler's life.

Layers, outermost first (each one a small ASGI middleware with one job):
security headers on every answer; the Host check when bound to loopback; the
`--auth-token` gate; CSRF on every state-changing request; then the routes.
They wrap the whole Starlette app, so even its error pages pass through them.
A read-only dashboard (`Settings.read_only`) also refuses every state-changing
request, inside the Starlette app so that its refusal is a page like the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

from fila import __version__
from fila.dashboard.asgi import ASGIApp
from fila.dashboard.auth import AuthMiddleware, TokenGate
from fila.dashboard.broker import Broker, Connection
from fila.dashboard.context import Dashboard
from fila.dashboard.csrf import CsrfMiddleware, CsrfTokens
from fila.dashboard.flash import Flasher
from fila.dashboard.headers import LoopbackHostMiddleware, SecurityHeadersMiddleware
from fila.dashboard.readonly import ReadOnlyMiddleware
from fila.dashboard.sampler import Sampler
from fila.dashboard.views import (
    apikeys,
    config,
    dlq,
    login,
    overview,
    queue,
    queue_edit,
    scheduled,
)


@dataclass(frozen=True, slots=True)
class Settings:
    connection: Connection
    port: int
    loopback: bool
    auth_token: str | None = None
    # `--allow-writes-on-loopback`: changes without a token, for whoever can connect.
    allow_writes: bool = False
    sample_interval: float = 2.0
    # Minutes of samples kept in memory for the charts.
    retention: float = 600.0

    @property
    def read_only(self) -> bool:
        """Without a token, anyone who can connect (any local process, on loopback) acts
        with the dashboard's API key, often a superadmin's: so the dashboard changes
        nothing unless a token is required or writes were explicitly allowed."""
        return self.auth_token is None and not self.allow_writes


def create_app(settings: Settings) -> ASGIApp:
    """The dashboard as one ASGI app (the broker is only contacted once it starts)."""
    # Sessions, CSRF tokens and notices are signed with a key that lives and dies
    # with the process: a restart logs everyone out, and nothing secret is on disk.
    secret = secrets.token_bytes(32)
    gate = TokenGate(settings.auth_token, secret)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        broker = Broker(settings.connection)
        sampler = Sampler(broker, interval=settings.sample_interval, retention=settings.retention)
        app.state.dashboard = Dashboard(
            broker, sampler, gate, Flasher(secret), __version__, read_only=settings.read_only
        )
        await sampler.sample()  # the first page already has data (or the banner)
        task = asyncio.create_task(sampler.run(), name="fila-dashboard-sampler")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await broker.close()

    static = StaticFiles(directory=Path(__file__).parent / "static")
    routes = [
        *overview.routes,
        *queue.routes,
        *queue_edit.routes,
        *scheduled.routes,
        *dlq.routes,
        *config.routes,
        *apikeys.routes,
        *login.routes,
        Mount("/static", static, name="static"),
    ]
    inner = [Middleware(ReadOnlyMiddleware)] if settings.read_only else []
    app: ASGIApp = Starlette(routes=routes, middleware=inner, lifespan=lifespan)
    app = CsrfMiddleware(app, CsrfTokens(secret))
    app = AuthMiddleware(app, gate)
    if settings.loopback:
        app = LoopbackHostMiddleware(app, settings.port)
    return SecurityHeadersMiddleware(app)
