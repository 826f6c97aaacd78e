"""Reaching the broker: the address checked before connecting, then one health probe
that fails fast and, when it fails, says why (see `diagnose`).

A command calls `connect(ctx)` once; the client closes when the command ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

import click
import grpc

from fila.cli import diagnose, raw
from fila.cli.context import options
from fila.cli.errors import Failure
from fila.cli.files import optional_file
from fila.wire import DEFAULT_ADDR, is_port
from fila_sdk import Client, FilaError

# An unreachable broker should fail a human's command quickly, not hang.
CONNECT_TIMEOUT_S: Final = 3.0
# Admin RPCs are short; the bound only guards against a wedged broker.
CALL_TIMEOUT_S: Final = 60.0
DEFAULT_PORT: Final = int(DEFAULT_ADDR.rpartition(":")[2])

# gRPC target URIs (unix:/path, dns:///host:port, ipv4:..., ...) go to gRPC as they are.
_SCHEMES: Final = ("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:", "xds:")
# Failures that mean "no broker reached"; anything else the command's own call reports.
_UNREACHED: Final = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNIMPLEMENTED,
)
_URL: Final = re.compile(r"(?i)(?:https?|grpcs?)://(?P<rest>[^/]*)")
_BRACKETED: Final = re.compile(r"\[(?P<host>[^\]]+)\](?::(?P<port>.*))?")


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def endpoint(addr: str) -> Endpoint | None:
    """The host and port of `addr`, or None for a gRPC target URI (`unix:/run/fila`).

    gRPC fills in port 443 when none is given, which is never a Fila broker, so an
    address without a port is refused here with the likely fix.
    """
    if addr.lower().startswith(_SCHEMES):
        return None
    if match := _URL.match(addr):  # a URL, which gRPC does not take
        raise Failure(
            f'address "{addr}" is a URL: give host:port (e.g. {match["rest"] or DEFAULT_ADDR}), '
            "and --tls for TLS"
        )
    if match := _BRACKETED.fullmatch(addr):
        host, port = match["host"], match["port"] or ""
    elif addr.count(":") > 1:
        raise Failure(
            f'address "{addr}" looks like an IPv6 address without a port: '
            f"write it as [{addr}]:{DEFAULT_PORT}"
        )
    else:
        host, _, port = addr.partition(":")
    if not host:
        raise Failure(f'address "{addr}" has no host: use localhost:{port or DEFAULT_PORT}')
    shown = f"[{host}]" if ":" in host else host
    if not port:
        raise Failure(
            f'address "{addr}" has no port: use {shown}:{DEFAULT_PORT} '
            f"(the broker's default port) in --addr or FILA_ADDR"
        )
    if not is_port(port):
        raise Failure(f'address "{addr}" has an invalid port "{port}": use a number 1-65535')
    return Endpoint(host, int(port))


def open_client(ctx: click.Context) -> Client:
    """A client for this invocation, closed with its context; not yet known to reach
    anything (see `connect`)."""
    opts = options(ctx)
    endpoint(opts.addr)
    try:
        client = Client(
            opts.addr,
            tls=opts.tls,
            ca_cert=optional_file(opts.ca_cert, "CA certificate"),
            client_cert=optional_file(opts.client_cert, "client certificate"),
            client_key=optional_file(opts.client_key, "client key"),
            api_key=opts.api_key,
            timeout=CALL_TIMEOUT_S,
        )
    except ValueError as err:
        raise Failure(str(err)) from err
    return ctx.with_resource(client)


def connect(ctx: click.Context) -> Client:
    """A client that has just reached the broker: one health check, failing at once
    with the reason (refused, unresolvable, TLS mismatch, ...) when it cannot."""
    client = open_client(ctx)
    try:
        raw.health(client, "", CONNECT_TIMEOUT_S)
    except FilaError as err:
        if err.code in _UNREACHED:
            raise unreachable(ctx, err) from err
    return client


def unreachable(ctx: click.Context, err: FilaError) -> Failure:
    """`err`, from a call that found no broker, as the failure to show."""
    opts = options(ctx)
    if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Failure(diagnose.unreachable(opts, endpoint(opts.addr), err, CONNECT_TIMEOUT_S))
    if err.code == grpc.StatusCode.UNIMPLEMENTED:
        return Failure(
            f"{opts.addr} answered, but not as a Fila broker (it has no grpc.health.v1 "
            "service): check --addr / FILA_ADDR"
        )
    return Failure(err.message)
