"""`fila redrive`: move dead-lettered messages back to their queue."""

from __future__ import annotations

import click

from fila.cli.connection import connect
from fila.cli.context import command
from fila.cli.output import emit


@command("redrive")
@click.argument("dlq")
@click.option(
    "--count",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Move at most this many messages (0 = all).",
)
@click.pass_context
def redrive(ctx: click.Context, dlq: str, count: int) -> None:
    """Move dead-lettered messages from DLQ back to their queue."""
    moved = connect(ctx).redrive(dlq, count)
    emit(ctx, {"dlq": dlq, "redriven": moved}, f'Redrove {moved} message(s) from "{dlq}"')
