"""Page rendering: the Jinja2 environment, its filters, and the context every page shares.

Autoescaping is on for every template, whatever its name (the environment is
built here with `autoescape=True` rather than relying on file extensions), and no
template uses `|safe` or `Markup`: message payloads, headers,
config values and broker error text all arrive as plain strings and leave as text.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import jinja2
from google.protobuf.timestamp_pb2 import Timestamp
from starlette.requests import Request
from starlette.responses import Response
from starlette.templating import Jinja2Templates

from fila.dashboard.context import of
from fila.durations import format_ms
from fila.v1 import admin_pb2

_ENV: Final = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
)
TEMPLATES: Final = Jinja2Templates(env=_ENV)
PAYLOAD_PREVIEW_CHARS: Final = 200
ERROR_PREVIEW_CHARS: Final = 120


def timestamp(value: Timestamp | None) -> str:
    """A protobuf Timestamp as UTC text; unset (zero) means it did not happen."""
    if value is None or (value.seconds == 0 and value.nanos == 0):
        return "—"
    moment = datetime.fromtimestamp(value.seconds + value.nanos / 1e9, UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.nanos // 1_000_000:03d} UTC"


def millis(value: int) -> str:
    if not value:
        return "never"
    return datetime.fromtimestamp(value / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def rate(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}/s" if value < 100 else f"{value:,.0f}/s"


def percent(value: float | None) -> str:
    return "—" if value is None else f"{value * 100:.1f}%"


def ago(at: float | None) -> str:
    """A monotonic instant as "N s ago"."""
    if at is None:
        return "never"
    seconds = max(0.0, time.monotonic() - at)
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def until(value: Timestamp | None) -> str:
    """How long until a protobuf Timestamp, by this machine's clock: "in 9m58s", or
    "now" once it has passed (a due message the broker has not moved yet, a lease
    about to be taken back)."""
    if value is None or (value.seconds == 0 and value.nanos == 0):
        return "—"
    remaining_ms = value.ToMilliseconds() - int(time.time() * 1000)
    if remaining_ms <= 0:
        return "now"
    return "in " + format_ms(math.ceil(remaining_ms / 1000) * 1000)


def error_preview(text: str) -> tuple[str, bool]:
    """(preview, clipped): an error's first line cut to a table cell's width; the whole
    text is shown on request (a nack may carry a stack trace of up to 4 KiB)."""
    first = text.strip().split("\n", 1)[0].rstrip()
    preview = first if len(first) <= ERROR_PREVIEW_CHARS else first[:ERROR_PREVIEW_CHARS] + "…"
    return preview, preview != text.strip()


def state_name(state: admin_pb2.PeekedState | None) -> str:
    """`ready`, `delayed`, `leased` ("" from a broker that does not report states)."""
    if state is None or state.state == admin_pb2.MESSAGE_STATE_UNSPECIFIED:
        return ""
    return admin_pb2.MessageState.Name(state.state).lower()


def payload_preview(payload: bytes) -> tuple[str, bool]:
    """(text, is_binary): UTF-8 text cut to a preview, else a hex dump of the start."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return payload[:48].hex(" "), True
    if len(text) > PAYLOAD_PREVIEW_CHARS:
        text = text[:PAYLOAD_PREVIEW_CHARS] + "…"
    return text, False


TEMPLATES.env.filters.update(
    timestamp=timestamp,
    millis=millis,
    rate=rate,
    percent=percent,
    ago=ago,
    until=until,
    duration=format_ms,
)
TEMPLATES.env.globals.update(
    payload_preview=payload_preview, error_preview=error_preview, state_name=state_name
)


def page(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> Response:
    """Render `name` with what every page shows: broker status, notices, CSRF token."""
    dash = of(request)
    flash = dash.flasher.read(request)
    response = TEMPLATES.TemplateResponse(
        request,
        name,
        {
            "csrf_token": request.state.csrf_token,
            "snapshot": dash.sampler.snapshot,
            "broker_addr": dash.broker.addr,
            "refresh_ms": int(dash.sampler.interval * 1000),
            "auth_enabled": dash.gate.enabled,
            "read_only": dash.read_only,
            "version": dash.version,
            "flash": flash,
            **context,
        },
        status_code=status_code,
    )
    if flash is not None:
        dash.flasher.clear(response)
    return response


def fragment(request: Request, name: str, context: dict[str, Any]) -> Response:
    """A live-refresh fragment: no notices consumed, same escaping."""
    dash = of(request)
    return TEMPLATES.TemplateResponse(
        request,
        name,
        {"snapshot": dash.sampler.snapshot, "broker_addr": dash.broker.addr, **context},
    )
