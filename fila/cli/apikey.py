"""`fila apikey ...`: create, list and revoke API keys (superadmin keys only)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import click
from rich.table import Table

from fila.cli.connection import connect
from fila.cli.context import group
from fila.cli.durations import option_ms
from fila.cli.output import emit
from fila_sdk import ApiKeyInfo


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="seconds")


def _short_time(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone().strftime("%Y-%m-%d %H:%M")


def _key_json(info: ApiKeyInfo) -> dict[str, Any]:
    return {
        "key_id": info.key_id,
        "name": info.name,
        "created_at": _iso(info.created_at),
        "expires_at": _iso(info.expires_at),
        "is_superadmin": info.is_superadmin,
    }


def _lifetime_ms(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    ms = option_ms(ctx, param, value)
    if ms == 0:
        raise click.BadParameter("the duration must be positive", ctx, param)
    return ms


@group()
def apikey() -> None:
    """Create, list and revoke API keys (superadmin keys only)."""


@apikey.command("create")
@click.argument("name")
@click.option("--superadmin", is_flag=True, help="The key bypasses ACLs and may manage keys.")
@click.option(
    "--expires-in",
    metavar="DURATION",
    callback=_lifetime_ms,
    help="Expire the key after this long, e.g. 90d, 12h, 1h30m (default: never).",
)
@click.pass_context
def apikey_create(ctx: click.Context, name: str, superadmin: bool, expires_in: int | None) -> None:
    """Create API key NAME and print its secret (shown only this once)."""
    expires_at = None
    if expires_in is not None:
        expires_at = datetime.fromtimestamp(time.time() + expires_in / 1000).astimezone()
    created = connect(ctx).create_api_key(name, superadmin=superadmin, expires_at=expires_at)
    emit(
        ctx,
        {
            "key_id": created.key_id,
            "key": created.key,
            "name": name,
            "is_superadmin": created.is_superadmin,
            "expires_at": _iso(expires_at),
        },
        f'Created API key "{name}" (id {created.key_id}'
        + (", superadmin" if created.is_superadmin else "")
        + (f", expires {_iso(expires_at)}" if expires_at else "")
        + ").",
        "Secret (shown only now; store it safely):",
        created.key,
    )


@apikey.command("list")
@click.pass_context
def apikey_list(ctx: click.Context) -> None:
    """List API keys (never their secrets)."""
    keys = connect(ctx).list_api_keys()
    table = Table()
    # Ids are copied into other commands: never shorten them.
    table.add_column("key id", no_wrap=True, min_width=16)
    for header in ("name", "created", "expires", "super"):
        table.add_column(header)
    for k in keys:
        table.add_row(
            k.key_id,
            k.name,
            _short_time(k.created_at) or "-",
            _short_time(k.expires_at) or "never",
            "yes" if k.is_superadmin else "no",
        )
    emit(ctx, [_key_json(k) for k in keys], table if keys else "No API keys.")


@apikey.command("revoke")
@click.argument("key_id")
@click.pass_context
def apikey_revoke(ctx: click.Context, key_id: str) -> None:
    """Revoke KEY_ID at once; its open streams end."""
    connect(ctx).revoke_api_key(key_id)
    emit(ctx, {"key_id": key_id, "revoked": True}, f"Revoked API key {key_id}")
