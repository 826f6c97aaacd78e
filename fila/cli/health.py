"""`fila health`: the broker's standard gRPC health check, for scripts and probes.

Exit status 0 only when the broker answers SERVING; NOT_SERVING (a broker shutting
down), an unknown service and an unreachable broker exit 1 with one line saying
which.
"""

from __future__ import annotations

import click
import grpc

from fila.cli import raw
from fila.cli.connection import CONNECT_TIMEOUT_S, open_client, unreachable
from fila.cli.context import command, options
from fila.cli.errors import Failure
from fila.cli.output import emit
from fila_sdk import FilaError


@command("health")
@click.option(
    "--service",
    default="",
    metavar="NAME",
    help="Check one service (e.g. fila.v1.FilaService) instead of the whole broker.",
)
@click.pass_context
def health(ctx: click.Context, service: str) -> None:
    """Check the broker with grpc.health.v1; exit 0 only when it is SERVING."""
    addr = options(ctx).addr
    client = open_client(ctx)
    try:
        status = raw.status_name(raw.health(client, service, CONNECT_TIMEOUT_S))
    except FilaError as err:
        if err.code == grpc.StatusCode.NOT_FOUND:
            raise Failure(f'the broker at {addr} has no service "{service}"') from err
        raise unreachable(ctx, err) from err
    emit(ctx, {"addr": addr, "service": service, "status": status}, status)
    if status != "SERVING":
        raise Failure(f"the broker at {addr} is {status}")
