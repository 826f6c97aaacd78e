"""What commands print: JSON on stdout under `--json`, else rich text and tables.

Broker data (config values, headers, payloads, error text) is printed with rich
markup off, so `[bold]` in a payload stays text.
"""

from __future__ import annotations

import base64
import json
from datetime import datetime
from typing import Any

import click
from rich.console import Console, RenderableType
from rich.table import Table

from fila.cli.context import options
from fila_sdk import Message, PeekedState

PAYLOAD_PREVIEW_CHARS = 60


def as_json(ctx: click.Context) -> bool:
    return options(ctx).as_json


# Output that is not a terminal (a pipe, a file) is not cut to 80 columns: a reader
# there has no window to fit, and a truncated message id is useless.
PIPE_WIDTH = 1000


def console() -> Console:
    out = Console(markup=False, highlight=False, emoji=False)
    if not out.is_terminal:
        out.width = PIPE_WIDTH
    return out


def emit(ctx: click.Context, data: object, *human: RenderableType) -> None:
    """Print `data` as JSON under `--json`, else the human renderables."""
    if as_json(ctx):
        click.echo(json.dumps(data))
        return
    out = console()
    for item in human:
        out.print(item, soft_wrap=isinstance(item, str))


def numbers_table(key: str, *numbers: str, title: str | None = None) -> Table:
    """A table keyed by its first column, with right-aligned numeric columns."""
    table = Table(key, title=title)
    for header in numbers:
        table.add_column(header, justify="right")
    return table


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat(timespec="milliseconds")


def _text(payload: bytes) -> str | None:
    try:
        return payload.decode()
    except UnicodeDecodeError:
        return None


def message_json(message: Message, state: PeekedState | None = None) -> dict[str, Any]:
    """A message for `--json`: lossless (`payload_base64`), and readable (`payload`,
    the UTF-8 text, or null when the payload is not UTF-8); with its peeked state."""
    extra: dict[str, Any] = {}
    if state is not None:
        extra = {
            "state": state.state,
            "ready_at": _iso(state.ready_at),
            "lease_deadline": _iso(state.lease_deadline),
        }
    return {
        "id": message.id,
        "queue": message.queue,
        "fairness_key": message.fairness_key,
        "weight": message.weight,
        "throttle_keys": list(message.throttle_keys),
        "attempt_count": message.attempt_count,
        "enqueued_at": _iso(message.enqueued_at),
        "leased_at": _iso(message.leased_at),
        "headers": message.headers,
        "payload": _text(message.payload),
        "payload_base64": base64.b64encode(message.payload).decode(),
        "last_error": message.last_error or None,
        "last_failed_at": _iso(message.last_failed_at),
        "dead_lettered_at": _iso(message.dead_lettered_at),
        **extra,
    }


def payload_preview(payload: bytes, limit: int | None = PAYLOAD_PREVIEW_CHARS) -> str:
    """The payload as a quoted string (escapes visible), or its size when binary."""
    text = _text(payload)
    if text is None:
        return f"<{len(payload)} bytes, not UTF-8>"
    if limit is not None and len(text) > limit:
        return json.dumps(text[:limit], ensure_ascii=False)[:-1] + '..."'
    return json.dumps(text, ensure_ascii=False)


def headers_text(headers: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(headers.items()))


def short_time(moment: datetime | None) -> str:
    return "" if moment is None else moment.astimezone().strftime("%H:%M:%S.%f")[:-3]


def message_line(message: Message) -> str:
    """One message on one line, for messages printed as they arrive."""
    parts = [
        short_time(message.enqueued_at),
        message.id,
        f"key={message.fairness_key}",
        f"attempts={message.attempt_count}",
    ]
    if message.headers:
        parts.append(headers_text(message.headers))
    parts.append(payload_preview(message.payload, None))
    return "  ".join(parts)


def state_text(message: Message, state: PeekedState | None) -> str:
    """`ready`, `delayed until 14:05:00.000`, `leased until ... (attempt 3)`."""
    if state is None:  # a broker that does not report states
        return "leased" if message.leased_at is not None else "queued"
    if state.state == "delayed" and state.ready_at is not None:
        return f"delayed until {short_time(state.ready_at)}"
    if state.state == "leased":
        until = f" until {short_time(state.lease_deadline)}" if state.lease_deadline else ""
        return f"leased{until} (attempt {message.attempt_count + 1})"
    return state.state


def messages_table(
    messages: list[Message], states: list[PeekedState | None] | None = None
) -> Table:
    table = Table(title=None)
    table.add_column("id", no_wrap=True)
    failed = any(m.last_error for m in messages)
    headers = ["key", "attempts", "state", "headers", "payload"]
    headers += ["last error"] if failed else []
    for header in headers:
        table.add_column(header, justify="right" if header == "attempts" else "left")
    for index, m in enumerate(messages):
        state = states[index] if states is not None and index < len(states) else None
        row = [
            m.id,
            m.fairness_key,
            str(m.attempt_count),
            state_text(m, state),
            headers_text(m.headers),
            payload_preview(m.payload),
        ]
        if failed:
            row.append(payload_preview(m.last_error.encode()) if m.last_error else "")
        table.add_row(*row)
    return table
