"""The `fila` command: queue, runtime-config and redrive administration.

A thin shell over `fila_sdk.Client`. Every expected failure (a broker error, an
unreadable file, an unreachable broker) becomes one `fila: error: ...` line on
stderr and exit status 1, so the command composes in scripts; `--json` prints
machine-readable results on stdout for the same reason.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import click
from rich.console import Console, RenderableType
from rich.table import Table

from fila.wire import DEFAULT_ADDR
from fila_sdk import Client, FilaError, QueueStats

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


def main() -> None:
    cli(prog_name="fila")


if __name__ == "__main__":
    main()
