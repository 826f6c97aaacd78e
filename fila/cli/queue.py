"""`fila queue ...`: create, show, update, delete, list, inspect (optionally live), peek
and purge."""

from __future__ import annotations

import sys
import time
from typing import Any, Final

import click

from fila.cli import live, raw
from fila.cli.connection import connect
from fila.cli.context import F, group
from fila.cli.durations import Duration
from fila.cli.errors import Failure
from fila.cli.files import text_or_file
from fila.cli.output import emit, message_json, messages_table
from fila.cli.rates import Rates, Sample, rates
from fila.cli.views import (
    inspect_view,
    queue_config_json,
    queue_config_view,
    queues_json,
    queues_table,
    stats_json,
)
from fila.wire import parse_max_attempts
from fila_sdk import (
    Client,
    Message,
    PeekedState,
    QueueDetails,
    QueueInfo,
    QueueNotFoundError,
)

# The broker's largest peek page: `queue peek --count N` costs ceil(N / 1000) calls.
PEEK_PAGE: Final = 1000


def _watch_options(command: F) -> F:
    """`--watch`, `--interval` and the hidden `--iterations` (bounded runs for tests)."""
    for option in (
        click.option(
            "--iterations",
            type=click.IntRange(min=1),
            hidden=True,
            help="Stop after this many refreshes.",
        ),
        click.option(
            "--interval",
            type=Duration(min_ms=100, max_ms=86_400_000, seconds=True),
            default=1.0,
            show_default=True,
            metavar="DURATION",
            help="Time between refreshes in watch mode, e.g. 500ms, 2s (a plain number "
            "is seconds).",
        ),
        click.option(
            "--watch",
            "-w",
            is_flag=True,
            help="Refresh live, with rates from the broker's counters (Ctrl-C to stop).",
        ),
    ):
        command = option(command)
    return command


class _Attempts(click.ParamType):  # type: ignore[type-arg]
    """A number of attempts (at least 1), or `unlimited`."""

    name = "attempts"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int):
            return value
        try:
            return parse_max_attempts(str(value))
        except ValueError as err:
            self.fail(str(err), param, ctx)


def _retry_options(command: F) -> F:
    for option in (
        click.option(
            "--retry-backoff",
            metavar="POLICY",
            help='Wait between attempts without an on_failure hook: "exponential" (1s, '
            '2s, 4s... +-25%, at most 1h), "none", or "fixed:30s".',
        ),
        click.option(
            "--max-attempts",
            type=_Attempts(),
            metavar="N|unlimited",
            help="Failed attempts before a message is dead-lettered, without an "
            "on_failure hook (default 25).",
        ),
    ):
        command = option(command)
    return command


@group()
def queue() -> None:
    """Create, list, inspect, browse, purge and delete queues."""


@queue.command("create")
@click.argument("name")
@click.option("--on-enqueue", metavar="SCRIPT|@FILE", help="Lua on_enqueue hook.")
@click.option("--on-failure", metavar="SCRIPT|@FILE", help="Lua on_failure hook.")
@click.option(
    "--visibility-timeout",
    type=Duration(min_ms=1),
    metavar="DURATION",
    help="Lease duration, e.g. 30s, 5m (a plain number is milliseconds; broker default 30s).",
)
@_retry_options
@click.option(
    "--exist-ok",
    is_flag=True,
    help="Succeed if the queue already exists (its hooks and timeout are kept).",
)
@click.pass_context
def queue_create(
    ctx: click.Context,
    name: str,
    on_enqueue: str | None,
    on_failure: str | None,
    visibility_timeout: int | None,
    max_attempts: int | None,
    retry_backoff: str | None,
    exist_ok: bool,
) -> None:
    """Create queue NAME and its dead-letter queue NAME.dlq. Without an on_failure hook,
    a failed message is retried on the backoff curve and dead-lettered after
    --max-attempts (defaults: exponential from 1s to 1h, 25 attempts)."""
    on_enqueue_script = text_or_file(on_enqueue, "on_enqueue script")
    on_failure_script = text_or_file(on_failure, "on_failure script")
    queue_id = connect(ctx).create_queue(
        name,
        on_enqueue=on_enqueue_script,
        on_failure=on_failure_script,
        visibility_timeout_ms=visibility_timeout,
        max_attempts=max_attempts,
        retry_backoff=retry_backoff,
        exist_ok=exist_ok,
    )
    emit(
        ctx,
        {"name": name, "queue_id": queue_id},
        f'Created queue "{name}" (dead letters go to "{name}.dlq")',
    )


@queue.command("delete")
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Delete without asking for confirmation.")
@click.pass_context
def queue_delete(ctx: click.Context, name: str, yes: bool) -> None:
    """Delete queue NAME with its messages and its dead-letter queue. Asks for
    confirmation unless --yes is given."""
    client = connect(ctx)
    if not yes:
        if not sys.stdin.isatty():
            raise Failure(
                f'refusing to delete "{name}" without --yes: stdin is not a terminal, so '
                "there is no one to confirm"
            )
        stats = client.get_stats(name)
        held = stats.depth + stats.in_flight
        question = f'Delete queue "{name}", its {held} message(s) and its dead-letter queue?'
        if not click.confirm(question, err=True):
            raise Failure(f'delete of "{name}" cancelled; nothing was deleted')
    client.delete_queue(name)
    emit(ctx, {"name": name, "deleted": True}, f'Deleted queue "{name}"')


@queue.command("list")
@_watch_options
@click.pass_context
def queue_list(ctx: click.Context, watch: bool, interval: float, iterations: int | None) -> None:
    """List queues with their depth, in-flight count and consumers (and, in cluster
    mode, the node each lives on)."""
    client = connect(ctx)
    if not watch:
        queues, places = raw.queues(client)
        table = queues_table(queues, places=places) if queues else "No queues."
        emit(ctx, queues_json(queues, places=places), table)
        return
    samples: dict[str, Sample] = {}

    def frame() -> live.Frame:
        queues, places, rated = _list_with_rates(client, samples)
        return queues_json(queues, rated, places), queues_table(queues, rated, places)

    live.watch(ctx, frame, interval=interval, iterations=iterations)


def _list_with_rates(
    client: Client, samples: dict[str, Sample]
) -> tuple[list[QueueInfo], dict[str, raw.Place], dict[str, Rates]]:
    """ListQueues, then GetStats per queue for its counters (ListQueues has none);
    `samples` carries each queue's previous sample from one refresh to the next."""
    queues, places = raw.queues(client)
    rated: dict[str, Rates] = {}
    for q in queues:
        try:
            stats = client.get_stats(q.name)
        except QueueNotFoundError:
            continue  # deleted since the listing
        current = Sample(time.monotonic(), stats)
        rated[q.name] = rates(samples.get(q.name), current)
        samples[q.name] = current
    for gone in samples.keys() - rated.keys():
        del samples[gone]
    return queues, places, rated


@queue.command("inspect")
@click.argument("name")
@_watch_options
@click.pass_context
def queue_inspect(
    ctx: click.Context, name: str, watch: bool, interval: float, iterations: int | None
) -> None:
    """Show live scheduling stats and counters for queue NAME (and, in cluster mode,
    its node, and its replicas and in-sync set when it is replicated)."""
    client = connect(ctx)
    if not watch:
        stats, place = raw.stats(client, name)
        emit(ctx, stats_json(name, stats, place=place), inspect_view(name, stats, place=place))
        return
    previous: list[Sample] = []

    def frame() -> live.Frame:
        stats, place = raw.stats(client, name)
        current = Sample(time.monotonic(), stats)
        rated = rates(previous[-1] if previous else None, current)
        previous[:] = [current]
        return (
            stats_json(name, current.stats, rated, place),
            inspect_view(name, current.stats, rated, place),
        )

    live.watch(ctx, frame, interval=interval, iterations=iterations)


@queue.command("peek")
@click.argument("name")
@click.option(
    "--count",
    "-n",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Show at most this many messages.",
)
@click.option("--key", metavar="FAIRNESS_KEY", help="Only messages of this fairness key.")
@click.option(
    "--state",
    type=click.Choice(["ready", "delayed", "leased"]),
    help="Only messages in this state.",
)
@click.pass_context
def queue_peek(
    ctx: click.Context, name: str, count: int, key: str | None, state: str | None
) -> None:
    """Show queue NAME's messages (ready, delayed with the time they become ready,
    leased with their deadline) in id order, without leasing or changing anything;
    works on dead-letter queues (NAME.dlq) too, with each message's last error."""
    client = connect(ctx)
    messages: list[Message] = []
    states: list[PeekedState | None] = []
    after: str | None = None
    while len(messages) < count:
        page = client.peek(
            name,
            limit=min(count - len(messages), PEEK_PAGE),
            after_id=after,
            fairness_key=key,
            state=state,
        )
        messages += page.messages
        states += page.states or [None] * len(page.messages)
        if page.next_after_id is None:
            break
        after = page.next_after_id
    emit(
        ctx,
        [message_json(m, s) for m, s in zip(messages, states, strict=True)],
        messages_table(messages, states) if messages else f'No messages in "{name}".',
    )


@queue.command("show")
@click.argument("name")
@click.pass_context
def queue_show(ctx: click.Context, name: str) -> None:
    """Show queue NAME's configuration (hooks, visibility timeout, retry policy, DLQ)."""
    details = connect(ctx).get_queue(name)
    emit(ctx, queue_config_json(details), queue_config_view(details))


@queue.command("update")
@click.argument("name")
@click.option("--on-enqueue", metavar="SCRIPT|@FILE", help='Lua on_enqueue hook ("" removes it).')
@click.option("--on-failure", metavar="SCRIPT|@FILE", help='Lua on_failure hook ("" removes it).')
@click.option(
    "--visibility-timeout",
    type=Duration(min_ms=1),
    metavar="DURATION",
    help="Lease duration, e.g. 30s, 5m (a plain number is milliseconds).",
)
@_retry_options
@click.pass_context
def queue_update(
    ctx: click.Context,
    name: str,
    on_enqueue: str | None,
    on_failure: str | None,
    visibility_timeout: int | None,
    max_attempts: int | None,
    retry_backoff: str | None,
) -> None:
    """Change the given settings of queue NAME; the others stay. Scripts are checked
    before anything changes; messages enqueued after the change see it."""
    config = connect(ctx).update_queue(
        name,
        on_enqueue=None if on_enqueue is None else text_or_file(on_enqueue, "on_enqueue script"),
        on_failure=None if on_failure is None else text_or_file(on_failure, "on_failure script"),
        visibility_timeout_ms=visibility_timeout,
        max_attempts=max_attempts,
        retry_backoff=retry_backoff,
    )
    details = QueueDetails(name, config, None)
    emit(ctx, queue_config_json(details), f'Updated queue "{name}"', queue_config_view(details))


@queue.command("purge")
@click.argument("name")
@click.option("--yes", "-y", is_flag=True, help="Purge without asking for confirmation.")
@click.pass_context
def queue_purge(ctx: click.Context, name: str, yes: bool) -> None:
    """Delete every ready and delayed message of queue NAME. Leased messages are left
    to finish (ack, nack or expire). Asks for confirmation unless --yes is given."""
    client = connect(ctx)
    if not yes:
        if not sys.stdin.isatty():
            raise Failure(
                f'refusing to purge "{name}" without --yes: stdin is not a terminal, so '
                "there is no one to confirm"
            )
        depth = client.get_stats(name).depth
        question = (
            f'Delete the {depth} ready and delayed message(s) of "{name}"? '
            "Leased messages are left to finish."
        )
        if not click.confirm(question, err=True):
            raise Failure(f'purge of "{name}" cancelled; nothing was deleted')
    purged = client.purge(name)
    emit(ctx, {"queue": name, "purged": purged}, f'Purged {purged} message(s) from "{name}"')
