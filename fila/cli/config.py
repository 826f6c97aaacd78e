"""`fila config ...`: the broker's runtime configuration (throttles, Lua settings)."""

from __future__ import annotations

from dataclasses import asdict

import click
from rich.table import Table

from fila.cli.connection import connect
from fila.cli.context import group
from fila.cli.output import emit


@group()
def config() -> None:
    """Read and write the broker's runtime configuration (throttles, Lua settings)."""


@config.command("set")
@click.argument("key")
@click.argument("value")
@click.pass_context
def config_set(ctx: click.Context, key: str, value: str) -> None:
    """Set KEY to VALUE (an empty VALUE removes a throttle)."""
    connect(ctx).set_config(key, value)
    emit(ctx, {"key": key, "value": value}, f"{key} = {value}")


@config.command("get")
@click.argument("key")
@click.pass_context
def config_get(ctx: click.Context, key: str) -> None:
    """Print the value of KEY."""
    value = connect(ctx).get_config(key)
    emit(ctx, {"key": key, "value": value}, value)


@config.command("list")
@click.option("--prefix", default="", help="Only keys starting with this prefix.")
@click.pass_context
def config_list(ctx: click.Context, prefix: str) -> None:
    """List configuration entries."""
    listing = connect(ctx).list_config(prefix)
    table = Table("key", "value")
    for entry in listing.entries:
        table.add_row(entry.key, entry.value)
    emit(
        ctx,
        asdict(listing),
        table if listing.entries else "No entries.",
        f"{listing.total_count} total",
    )
