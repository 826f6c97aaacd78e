"""`fila enqueue` publishes one message; `fila tail` prints messages as they arrive.

`tail` has two modes, because following a queue from outside is either reading
or consuming:
- `--no-ack` (the default) changes nothing: it browses with PeekMessages every
  `POLL_INTERVAL_S` and prints messages it has not shown before. Nothing is leased,
  no attempt is counted, consumers are not disturbed. A message that is enqueued
  and acked between two polls is not seen. Arrivals are the messages whose id sorts
  after the newest one seen (new enqueues); on a dead-letter queue, whose messages
  arrive with the ids they had in their queue, every poll reads the whole DLQ.
- `--ack` is a consumer: it leases messages (the backlog first), prints each and
  acks it. It holds one message at a time, so Ctrl-C leaves at most that one leased
  until its visibility timeout.
"""

from __future__ import annotations

import json
import time
from collections.abc import Generator
from typing import Final

import click

from fila.cli import raw
from fila.cli.connection import connect
from fila.cli.context import command
from fila.cli.durations import format_ms, option_ms
from fila.cli.files import bytes_from
from fila.cli.output import as_json, emit, message_json, message_line
from fila.wire import dlq_owner
from fila_sdk import Client, Message

POLL_INTERVAL_S: Final = 0.25


def _headers(pairs: tuple[str, ...]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f'"{pair}" is not KEY=VALUE', param_hint="'--header'")
        if key in headers:
            raise click.BadParameter(f'header "{key}" is given twice', param_hint="'--header'")
        headers[key] = value
    return headers


@command("enqueue")
@click.argument("queue")
@click.argument("payload", metavar="(PAYLOAD | @FILE | -)")
@click.option(
    "--header",
    "-H",
    "header",
    multiple=True,
    metavar="KEY=VALUE",
    help="A message header; repeat for more.",
)
@click.option(
    "--delay",
    callback=option_ms,
    metavar="DURATION",
    help="Deliver no earlier than this from now, e.g. 250ms, 30s, 5m, 1h30m.",
)
@click.pass_context
def enqueue(
    ctx: click.Context, queue: str, payload: str, header: tuple[str, ...], delay: int | None
) -> None:
    """Enqueue one message to QUEUE. The payload is PAYLOAD itself, the contents of
    FILE (@FILE), or standard input (-)."""
    headers = _headers(header)
    body = bytes_from(payload, "payload file")
    message_id = raw.enqueue(connect(ctx), queue, headers, body, delay or 0)
    when = f" (ready in {format_ms(delay)})" if delay else ""
    emit(
        ctx,
        {"queue": queue, "message_id": message_id, "delay_ms": delay or 0},
        f'Enqueued {message_id} to "{queue}"{when}',
    )


@command("tail")
@click.argument("queue")
@click.option(
    "--ack/--no-ack",
    default=False,
    show_default=True,
    help="--ack consumes: leases, prints and acks each message (backlog first). "
    "--no-ack only reads: prints new arrivals, leasing and changing nothing.",
)
@click.option("--count", "-n", type=click.IntRange(min=1), help="Stop after this many messages.")
@click.pass_context
def tail(ctx: click.Context, queue: str, ack: bool, count: int | None) -> None:
    """Print QUEUE's messages as they arrive, until Ctrl-C (or --count messages).

    Under --json, one JSON object per line. A line on stderr says when tail is
    following; messages enqueued after it are printed.
    """
    client = connect(ctx)
    json_lines = as_json(ctx)
    stream = _consumed(client, queue) if ack else _arrivals(client, queue)
    shown = 0
    try:
        for message in stream:
            click.echo(json.dumps(message_json(message)) if json_lines else message_line(message))
            shown += 1
            last = count is not None and shown >= count
            if last:
                # Before the ack: the ack frees the stream's one message of credit, and
                # a message sent on a Consume stream stays leased after the stream ends.
                stream.close()
            if ack:
                client.ack(queue, message.id)
            if last:
                return
    except KeyboardInterrupt:
        return  # Ctrl-C is how a tail ends
    finally:
        stream.close()


def _following(queue: str, how: str) -> None:
    click.echo(f'fila: following "{queue}" ({how}); Ctrl-C to stop', err=True)


def _consumed(client: Client, queue: str) -> Generator[Message, None, None]:
    messages = raw.consume(client, queue, prefetch=1)
    _following(queue, "consuming and acking")
    yield from messages


def _arrivals(client: Client, queue: str) -> Generator[Message, None, None]:
    """Messages that appear in `queue` from now on, found by peeking (see module doc)."""
    whole_queue = dlq_owner(queue) is not None
    known: set[str] = set()
    newest: str | None = None
    for message in client.peek_all(queue):  # what is there now is not an arrival
        if whole_queue:
            known.add(message.id)
        newest = message.id
    _following(queue, "reading only; nothing is leased or acked")
    while True:
        if whole_queue:
            present = list(client.peek_all(queue))
            yield from (m for m in present if m.id not in known)
            known = {m.id for m in present}
        else:
            for message in client.peek_all(queue, after_id=newest):
                newest = message.id
                yield message
        time.sleep(POLL_INTERVAL_S)
