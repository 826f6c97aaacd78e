"""`fila acl ...`: grant and read the per-queue permissions of API keys."""

from __future__ import annotations

from dataclasses import asdict

import click
from rich.table import Table

from fila.cli.connection import connect
from fila.cli.context import group
from fila.cli.output import emit
from fila_sdk import AclPermission


def _permission(text: str) -> AclPermission:
    try:
        return AclPermission.parse(text)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="KIND:PATTERN") from err


@group()
def acl() -> None:
    """Grant and read per-queue permissions of API keys."""


@acl.command("set")
@click.argument("key_id")
@click.argument("permissions", nargs=-1, required=True, metavar="KIND:PATTERN...")
@click.pass_context
def acl_set(ctx: click.Context, key_id: str, permissions: tuple[str, ...]) -> None:
    """Replace KEY_ID's permissions. KIND is produce, consume or admin; PATTERN is *,
    a queue name, or prefix.* (e.g. produce:orders consume:acme.*)."""
    parsed = [_permission(p) for p in permissions]
    connect(ctx).set_acl(key_id, parsed)
    emit(
        ctx,
        {"key_id": key_id, "permissions": [asdict(p) for p in parsed]},
        f"Set the ACL of {key_id}: {' '.join(map(str, parsed))}",
    )


@acl.command("get")
@click.argument("key_id")
@click.pass_context
def acl_get(ctx: click.Context, key_id: str) -> None:
    """Show KEY_ID's permissions."""
    got = connect(ctx).get_acl(key_id)
    table = Table("kind", "pattern")
    for p in got.permissions:
        table.add_row(p.kind, p.pattern)
    emit(
        ctx,
        asdict(got),
        f"API key {key_id}" + (" is a superadmin (bypasses ACLs)" if got.is_superadmin else ""),
        table if got.permissions else "No permissions.",
    )
