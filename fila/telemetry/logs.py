"""Structured logs: one line per event, logfmt or JSON, on stderr.

A line carries the time (UTC, RFC 3339, milliseconds), the level, the logger, the
event (`msg`) and the event's fields. Fields are passed with `extra=` at the call site
(`log.info("queue created", extra={"queue": name})`), so a log pipeline can filter on
them without parsing prose. A value is escaped so it cannot span lines or forge a
field: a Lua error text or a queue name with a newline or `" level=error` in it stays
inside its own quoted value.

What must never be logged (SPEC 5, docs/operations.md): message payloads, API keys.
No call site in the broker passes either; fields are only the names and numbers an
operator needs.

Libraries log through the same handler. OpenTelemetry's exporters log every failed
export and every retry; with a collector down that is a line every few seconds for as
long as it stays down, so `QuietLibraries` lets one line per message template through
per minute and counts the rest (`suppressed=N` on the next line that passes).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TextIO

from fila.config import LogFormat

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
}
# What every line starts with; a field of the same name is dropped rather than repeated.
_BASE_KEYS = frozenset(("ts", "level", "logger", "msg", "exc"))
# Loggers whose warnings are rate-limited (see the module docstring).
_NOISY_PREFIXES = ("opentelemetry", "grpc._cython")
# grpcio logs a metadata value that is not UTF-8 in full, with a traceback, once per
# call: an `authorization: Bearer <key>` with one stray byte would put the key in the
# log, and any peer could repeat it at will.
_UNDECODABLE_METADATA = "Invalid encoding on"
_QUIET_INTERVAL_S = 60.0


def event_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record carries besides the standard ones (from `extra=`); a field
    whose value is None is left out of the line."""
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


def _timestamp(record: logging.LogRecord) -> str:
    stamp = datetime.fromtimestamp(record.created, UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    parts = []
    if record.exc_info:
        parts.append(formatter.formatException(record.exc_info))
    elif record.exc_text:
        parts.append(record.exc_text)
    if record.stack_info:
        parts.append(formatter.formatStack(record.stack_info))
    return "\n".join(parts) or None


class LogfmtFormatter(logging.Formatter):
    """`ts=... level=info logger=fila.server msg="queue created" queue=orders`"""

    def format(self, record: logging.LogRecord) -> str:
        pairs: list[tuple[str, object]] = [
            ("ts", _timestamp(record)),
            ("level", record.levelname.lower()),
            ("logger", record.name),
            ("msg", record.getMessage()),
        ]
        pairs += [
            (k, v) for k, v in event_fields(record).items() if k not in _BASE_KEYS and v is not None
        ]
        error = _exception_text(self, record)
        if error is not None:
            pairs.append(("exc", error))
        return " ".join(f"{_logfmt_key(k)}={_logfmt_value(v)}" for k, v in pairs)


class JsonFormatter(logging.Formatter):
    """`{"ts": ..., "level": "info", "logger": ..., "msg": ..., <fields>}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in event_fields(record).items():
            if key not in _BASE_KEYS and value is not None:
                doc[key] = value
        error = _exception_text(self, record)
        if error is not None:
            doc["exc"] = error
        return json.dumps(doc, ensure_ascii=False, default=str, separators=(",", ":"))


def _logfmt_key(key: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "_" for c in key)
    return cleaned or "_"


def _logfmt_value(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if text and all(c.isprintable() and c not in ' ="\\' for c in text):
        return text
    # json.dumps quotes and escapes (\n, \", \\, control characters): one line, one value.
    return json.dumps(text, ensure_ascii=False)


class RedactMetadata(logging.Filter):
    """Replaces grpcio's report of undecodable call metadata (which quotes the value,
    an API key included) with a line that names no value and carries no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("grpc.") and str(record.msg).startswith(_UNDECODABLE_METADATA):
            record.msg = "refused a call whose metadata is not valid UTF-8 (value not logged)"
            record.args = None
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


class QuietLibraries(logging.Filter):
    """Lets one record per (logger, template) through per interval from noisy libraries."""

    def __init__(
        self, interval_s: float = _QUIET_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[tuple[str, object], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(_NOISY_PREFIXES):
            return True
        cause = (record.name, record.msg)
        now = self._clock()
        last, suppressed = self._last.get(cause, (-self._interval_s, 0))
        if now - last < self._interval_s:
            self._last[cause] = (last, suppressed + 1)
            return False
        if len(self._last) > 1000:
            self._last.clear()
        self._last[cause] = (now, 0)
        if suppressed:
            record.suppressed = suppressed
        return True


FORMATTERS: dict[str, type[logging.Formatter]] = {
    "logfmt": LogfmtFormatter,
    "json": JsonFormatter,
}


def configure_logging(level: str, log_format: LogFormat, stream: TextIO | None = None) -> None:
    """Sends every log record (the broker's and libraries') to `stream` (stderr), one
    line each, in `log_format`, at `level` and above."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(FORMATTERS[log_format]())
    handler.addFilter(RedactMetadata())  # first: the quiet filter then counts one template
    handler.addFilter(QuietLibraries())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
