"""`fila dashboard`: the click command that starts the web dashboard.

Kept free of web imports at module level: the `fila` CLI can register this command
even where the optional `dashboard` extra is not installed, and running it then
says how to install it instead of failing at import time.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Final

import click

from fila.cli.durations import Duration
from fila.dashboard.broker import Connection
from fila.wire import DEFAULT_ADDR, is_port

DEFAULT_LISTEN: Final = "127.0.0.1:8080"
# Long enough that guessing it over the network is hopeless.
MIN_TOKEN_CHARS: Final = 16


def parse_listen(value: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port)."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not is_port(port_text):
        raise click.BadParameter(f"expected HOST:PORT, got {value!r}", param_hint="--listen")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other name may resolve to a public interface


def _read(path: str | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise click.ClickException(f'cannot read {what} "{path}": {err.strerror or err}') from err


def _root_options() -> dict[str, Any]:
    """Connection options given to `fila` itself (`fila --addr X dashboard`), for those
    this command was not given directly: the dashboard connects like every command."""
    ctx = click.get_current_context()
    root = ctx.find_root().obj
    inherited: dict[str, Any] = {}
    for name in ("addr", "api_key", "tls", "ca_cert", "client_cert", "client_key"):
        if root is None or not hasattr(root, name):
            continue
        if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT:
            inherited[name] = getattr(root, name)
    return inherited


@click.command("dashboard")
@click.option(
    "--listen",
    default=DEFAULT_LISTEN,
    show_default=True,
    metavar="HOST:PORT",
    help="Where the web server listens. Anything but loopback requires --auth-token.",
)
@click.option(
    "--addr",
    default=DEFAULT_ADDR,
    show_default=True,
    envvar="FILA_ADDR",
    help="Broker address host:port.",
)
@click.option("--api-key", envvar="FILA_API_KEY", help="API key the dashboard sends to the broker.")
@click.option("--tls", is_flag=True, help="Connect with TLS (implied by any certificate option).")
@click.option("--ca-cert", metavar="PATH", help="CA certificate (PEM) to verify the broker.")
@click.option("--client-cert", metavar="PATH", help="Client certificate (PEM) for mTLS.")
@click.option("--client-key", metavar="PATH", help="Client private key (PEM) for mTLS.")
@click.option(
    "--auth-token",
    envvar="FILA_DASHBOARD_TOKEN",
    help="Token a browser must present (login form) or a script must send as Bearer.",
)
@click.option(
    "--allow-writes-on-loopback",
    is_flag=True,
    help="Without --auth-token the dashboard is read-only; this lets anyone who can "
    "connect (every local user and process) change the broker through it.",
)
@click.option(
    "--sample-interval",
    type=Duration(min_ms=200, max_ms=60_000, seconds=True),
    default=2.0,
    show_default=True,
    metavar="DURATION",
    help="How often the broker is sampled and open pages refresh, e.g. 500ms, 5s (a plain "
    "number is seconds).",
)
def dashboard(
    listen: str,
    addr: str,
    api_key: str | None,
    tls: bool,
    ca_cert: str | None,
    client_cert: str | None,
    client_key: str | None,
    auth_token: str | None,
    allow_writes_on_loopback: bool,
    sample_interval: float,
) -> None:
    """Serve the web dashboard for the broker at --addr."""
    inherited = _root_options()
    addr = inherited.get("addr", addr)
    api_key = inherited.get("api_key", api_key)
    tls = inherited.get("tls", tls)
    ca_cert = inherited.get("ca_cert", ca_cert)
    client_cert = inherited.get("client_cert", client_cert)
    client_key = inherited.get("client_key", client_key)
    host, port = parse_listen(listen)
    loopback = is_loopback(host)
    if auth_token is not None and len(auth_token) < MIN_TOKEN_CHARS:
        raise click.BadParameter(
            f"must be at least {MIN_TOKEN_CHARS} characters", param_hint="--auth-token"
        )
    if not loopback and not auth_token:
        raise click.UsageError(
            f"--listen {listen} is not a loopback address: set --auth-token "
            "(or FILA_DASHBOARD_TOKEN) so that only people with the token get in"
        )
    if (client_cert is None) != (client_key is None):
        raise click.UsageError("--client-cert and --client-key must be given together")
    connection = Connection(
        addr=addr,
        tls=tls,
        ca_cert=_read(ca_cert, "CA certificate"),
        client_cert=_read(client_cert, "client certificate"),
        client_key=_read(client_key, "client key"),
        api_key=api_key or None,
    )
    try:
        import uvicorn

        from fila.dashboard.app import Settings, create_app
    except ImportError as err:
        raise click.ClickException(
            f"the dashboard needs its optional dependencies ({err.name} is missing): "
            "pip install 'fila[dashboard]'"
        ) from err
    settings = Settings(
        connection=connection,
        port=port,
        loopback=loopback,
        auth_token=auth_token or None,
        allow_writes=allow_writes_on_loopback,
        sample_interval=sample_interval,
    )
    app = create_app(settings)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"fila dashboard: http://{shown}:{port}/ for broker {addr}", err=True)
    if settings.read_only:
        click.echo(
            "fila dashboard: read-only (changes nothing on the broker); to enable changes "
            "set --auth-token (or FILA_DASHBOARD_TOKEN), or --allow-writes-on-loopback",
            err=True,
        )
    uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="on",
            access_log=False,
            server_header=False,
            proxy_headers=False,
            log_level="info",
        )
    ).run()
