"""The `fila` command: queues, runtime config, redrive, API keys and ACLs.

A thin shell over `fila_sdk.Client`. Every expected failure (a broker error, an
unreadable file, an unreachable broker) becomes one `fila: error: ...` line on
stderr and exit status 1, so the command composes in scripts; `--json` prints
machine-readable results on stdout for the same reason.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Final, TypeVar

import click
from rich.console import Console, RenderableType
from rich.table import Table

from fila.wire import DEFAULT_ADDR
from fila_sdk import AclPermission, ApiKeyInfo, Client, FilaError, QueueStats

# An unreachable broker should fail a human's command quickly, not hang.
CONNECT_TIMEOUT_S: Final = 3.0
# Admin RPCs are short; the bound only guards against a wedged broker.
CALL_TIMEOUT_S: Final = 60.0


class Failure(click.ClickException):
    """An expected failure: one line on stderr, exit status 1, no traceback."""

    def show(self, file: Any = None) -> None:
        click.echo(f"fila: error: {' '.join(self.message.split())}", err=True)


@dataclass(frozen=True, slots=True)
class Options:
    addr: str
    as_json: bool
    api_key: str | None
    tls: bool
    ca_cert: str | None
    client_cert: str | None
    client_key: str | None


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise Failure(f'cannot read {what} "{path}": {err.strerror or err}') from err


def _optional_read(path: str | None, what: str) -> bytes | None:
    return None if path is None else _read(path, what)


def _script(value: str | None, hook: str) -> str | None:
    """`@path` names a file holding the script; anything else is the script itself."""
    if value is None or not value.startswith("@"):
        return value
    try:
        return _read(value[1:], f"{hook} script").decode()
    except UnicodeDecodeError as err:
        raise Failure(f'{hook} script "{value[1:]}" is not UTF-8 text') from err


def _client(ctx: click.Context) -> Client:
    """Connect once per invocation; the client closes when the command's context ends."""
    opts = ctx.find_object(Options)
    assert opts is not None, "the root group always sets Options"
    try:
        client = Client(
            opts.addr,
            tls=opts.tls,
            ca_cert=_optional_read(opts.ca_cert, "CA certificate"),
            client_cert=_optional_read(opts.client_cert, "client certificate"),
            client_key=_optional_read(opts.client_key, "client key"),
            api_key=opts.api_key,
            timeout=CALL_TIMEOUT_S,
        )
    except ValueError as err:
        raise Failure(str(err)) from err
    ctx.with_resource(client)
    client.wait_ready(CONNECT_TIMEOUT_S)
    return client


def _numbers_table(key: str, *numbers: str, title: str | None = None) -> Table:
    """A table keyed by its first column, with right-aligned numeric columns."""
    table = Table(key, title=title)
    for header in numbers:
        table.add_column(header, justify="right")
    return table


def _emit(ctx: click.Context, data: object, *human: RenderableType) -> None:
    """Print `data` as JSON under `--json`, else the human renderables."""
    opts = ctx.find_object(Options)
    if opts is not None and opts.as_json:
        click.echo(json.dumps(data))
        return
    # Broker data (config values, error text) must never be read as rich markup.
    console = Console(markup=False, highlight=False, emoji=False)
    for item in human:
        console.print(item, soft_wrap=isinstance(item, str))


class _Root(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FilaError as err:
            raise Failure(err.message) from err


@click.group(cls=_Root)
@click.option(
    "--addr",
    default=DEFAULT_ADDR,
    show_default=True,
    envvar="FILA_ADDR",
    help="Broker address host:port.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
@click.option("--api-key", envvar="FILA_API_KEY", help="API key sent as a bearer token.")
@click.option("--tls", is_flag=True, help="Connect with TLS (implied by any certificate option).")
@click.option("--ca-cert", metavar="PATH", help="CA certificate (PEM) to verify the broker.")
@click.option("--client-cert", metavar="PATH", help="Client certificate (PEM) for mTLS.")
@click.option("--client-key", metavar="PATH", help="Client private key (PEM) for mTLS.")
@click.pass_context
def cli(
    ctx: click.Context,
    addr: str,
    as_json: bool,
    api_key: str | None,
    tls: bool,
    ca_cert: str | None,
    client_cert: str | None,
    client_key: str | None,
) -> None:
    """Administer a Fila broker."""
    ctx.obj = Options(addr, as_json, api_key, tls, ca_cert, client_cert, client_key)


@cli.group()
def queue() -> None:
    """Create, list, inspect and delete queues."""


@queue.command("create")
@click.argument("name")
@click.option("--on-enqueue", metavar="SCRIPT|@FILE", help="Lua on_enqueue hook.")
@click.option("--on-failure", metavar="SCRIPT|@FILE", help="Lua on_failure hook.")
@click.option(
    "--visibility-timeout",
    type=click.IntRange(min=1),
    metavar="MS",
    help="Lease duration in milliseconds (broker default 30000).",
)
@click.pass_context
def queue_create(
    ctx: click.Context,
    name: str,
    on_enqueue: str | None,
    on_failure: str | None,
    visibility_timeout: int | None,
) -> None:
    """Create queue NAME and its dead-letter queue NAME.dlq."""
    on_enqueue_script = _script(on_enqueue, "on_enqueue")
    on_failure_script = _script(on_failure, "on_failure")
    queue_id = _client(ctx).create_queue(
        name,
        on_enqueue=on_enqueue_script,
        on_failure=on_failure_script,
        visibility_timeout_ms=visibility_timeout,
    )
    _emit(
        ctx,
        {"name": name, "queue_id": queue_id},
        f'Created queue "{name}" (dead letters go to "{name}.dlq")',
    )


@queue.command("delete")
@click.argument("name")
@click.pass_context
def queue_delete(ctx: click.Context, name: str) -> None:
    """Delete queue NAME with its messages and its dead-letter queue."""
    _client(ctx).delete_queue(name)
    _emit(ctx, {"name": name, "deleted": True}, f'Deleted queue "{name}"')


@queue.command("list")
@click.pass_context
def queue_list(ctx: click.Context) -> None:
    """List queues with their depth, in-flight count and consumers."""
    queues = _client(ctx).list_queues()
    table = _numbers_table("name", "depth", "in-flight", "consumers")
    for q in queues:
        table.add_row(q.name, str(q.depth), str(q.in_flight), str(q.active_consumers))
    _emit(ctx, [asdict(q) for q in queues], table if queues else "No queues.")


def _inspect_view(name: str, stats: QueueStats) -> list[RenderableType]:
    summary = Table.grid(padding=(0, 2))
    for label, value in (
        ("queue", name),
        ("depth", stats.depth),
        ("in-flight", stats.in_flight),
        ("consumers", stats.active_consumers),
        ("fairness keys", stats.active_fairness_keys),
        ("quantum", stats.quantum),
    ):
        summary.add_row(label, str(value))
    keys = _numbers_table("key", "pending", "deficit", "weight", title="Fairness keys")
    for k in stats.per_key:
        keys.add_row(k.key, str(k.pending_count), str(k.current_deficit), str(k.weight))
    throttles = _numbers_table("key", "tokens", "rate/s", "burst", title="Throttle keys")
    for t in stats.per_throttle:
        throttles.add_row(t.key, f"{t.tokens:g}", f"{t.rate_per_second:g}", f"{t.burst:g}")
    return [
        summary,
        keys if stats.per_key else "No active fairness keys.",
        throttles if stats.per_throttle else "No throttle keys.",
    ]


@queue.command("inspect")
@click.argument("name")
@click.pass_context
def queue_inspect(ctx: click.Context, name: str) -> None:
    """Show live scheduling stats for queue NAME."""
    stats = _client(ctx).get_stats(name)
    _emit(ctx, {"name": name, **asdict(stats)}, *_inspect_view(name, stats))


@cli.group()
def config() -> None:
    """Read and write the broker's runtime configuration (throttles, Lua settings)."""


@config.command("set")
@click.argument("key")
@click.argument("value")
@click.pass_context
def config_set(ctx: click.Context, key: str, value: str) -> None:
    """Set KEY to VALUE (an empty VALUE removes a throttle)."""
    _client(ctx).set_config(key, value)
    _emit(ctx, {"key": key, "value": value}, f"{key} = {value}")


@config.command("get")
@click.argument("key")
@click.pass_context
def config_get(ctx: click.Context, key: str) -> None:
    """Print the value of KEY."""
    value = _client(ctx).get_config(key)
    _emit(ctx, {"key": key, "value": value}, value)


@config.command("list")
@click.option("--prefix", default="", help="Only keys starting with this prefix.")
@click.pass_context
def config_list(ctx: click.Context, prefix: str) -> None:
    """List configuration entries."""
    listing = _client(ctx).list_config(prefix)
    table = Table("key", "value")
    for entry in listing.entries:
        table.add_row(entry.key, entry.value)
    _emit(
        ctx,
        asdict(listing),
        table if listing.entries else "No entries.",
        f"{listing.total_count} total",
    )


@cli.command("redrive")
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
    moved = _client(ctx).redrive(dlq, count)
    _emit(ctx, {"dlq": dlq, "redriven": moved}, f'Redrove {moved} message(s) from "{dlq}"')


# API keys and ACLs.

_F = TypeVar("_F", bound=Callable[..., Any])


def _set_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        opts = ctx.find_object(Options)
        assert opts is not None, "the root group always sets Options"
        ctx.obj = replace(opts, as_json=True)


def _json_here(command: _F) -> _F:
    """Also accept `--json` after the subcommand (`fila apikey list --json`)."""
    option = click.option(
        "--json",
        is_flag=True,
        expose_value=False,
        callback=_set_json,
        help="Print machine-readable JSON on stdout.",
    )
    return option(command)


_DURATION_UNITS_MS: Final = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION_RE: Final = re.compile(r"(\d+)(ms|s|m|h|d)")


def _duration_ms(text: str) -> int:
    """`90d`, `12h`, `1h30m`, `45s`, `500ms` -> milliseconds."""
    parts = _DURATION_RE.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise click.BadParameter(f'"{text}" is not a duration like 30d, 12h, 1h30m or 45s')
    total = sum(int(n) * _DURATION_UNITS_MS[u] for n, u in parts)
    if total <= 0:
        raise click.BadParameter("the duration must be positive")
    return total


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


def _permission(text: str) -> AclPermission:
    try:
        return AclPermission.parse(text)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="KIND:PATTERN") from err


@cli.group()
def apikey() -> None:
    """Create, list and revoke API keys (superadmin keys only)."""


@apikey.command("create")
@click.argument("name")
@click.option("--superadmin", is_flag=True, help="The key bypasses ACLs and may manage keys.")
@click.option(
    "--expires-in",
    metavar="DURATION",
    help="Expire the key after this long, e.g. 90d, 12h, 1h30m (default: never).",
)
@_json_here
@click.pass_context
def apikey_create(ctx: click.Context, name: str, superadmin: bool, expires_in: str | None) -> None:
    """Create API key NAME and print its secret (shown only this once)."""
    expires_at = None
    if expires_in is not None:
        try:
            expires_ms = _duration_ms(expires_in)
        except click.BadParameter as err:
            err.param_hint = "'--expires-in'"
            raise
        expires_at = datetime.fromtimestamp(time.time() + expires_ms / 1000).astimezone()
    created = _client(ctx).create_api_key(name, superadmin=superadmin, expires_at=expires_at)
    _emit(
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
@_json_here
@click.pass_context
def apikey_list(ctx: click.Context) -> None:
    """List API keys (never their secrets)."""
    keys = _client(ctx).list_api_keys()
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
    _emit(ctx, [_key_json(k) for k in keys], table if keys else "No API keys.")


@apikey.command("revoke")
@click.argument("key_id")
@_json_here
@click.pass_context
def apikey_revoke(ctx: click.Context, key_id: str) -> None:
    """Revoke KEY_ID at once; its open streams end."""
    _client(ctx).revoke_api_key(key_id)
    _emit(ctx, {"key_id": key_id, "revoked": True}, f"Revoked API key {key_id}")


@cli.group()
def acl() -> None:
    """Grant and read per-queue permissions of API keys."""


@acl.command("set")
@click.argument("key_id")
@click.argument("permissions", nargs=-1, required=True, metavar="KIND:PATTERN...")
@_json_here
@click.pass_context
def acl_set(ctx: click.Context, key_id: str, permissions: tuple[str, ...]) -> None:
    """Replace KEY_ID's permissions. KIND is produce, consume or admin; PATTERN is *,
    a queue name, or prefix.* (e.g. produce:orders consume:acme.*)."""
    parsed = [_permission(p) for p in permissions]
    _client(ctx).set_acl(key_id, parsed)
    _emit(
        ctx,
        {"key_id": key_id, "permissions": [asdict(p) for p in parsed]},
        f"Set the ACL of {key_id}: {' '.join(map(str, parsed))}",
    )


@acl.command("get")
@click.argument("key_id")
@_json_here
@click.pass_context
def acl_get(ctx: click.Context, key_id: str) -> None:
    """Show KEY_ID's permissions."""
    got = _client(ctx).get_acl(key_id)
    table = Table("kind", "pattern")
    for p in got.permissions:
        table.add_row(p.kind, p.pattern)
    _emit(
        ctx,
        asdict(got),
        f"API key {key_id}" + (" is a superadmin (bypasses ACLs)" if got.is_superadmin else ""),
        table if got.permissions else "No permissions.",
    )


def main() -> None:
    cli(prog_name="fila")


if __name__ == "__main__":
    main()
