"""The queue settings form: what it shows, and which settings a submission changes.

The form shows a queue's configuration as `GetQueue` answers it, in the words people
write (`30s`, `unlimited`), and `UpdateQueue` is sent only the settings the operator
changed. Each field carries a digest of the value it was shown with; a field whose
submitted value has the same digest is left out of the update mask. So a change made
elsewhere after the form was loaded (with the CLI, say) is not undone by saving another
field, and the form stays small however large the scripts are.

Browsers send a textarea's line breaks as CRLF: scripts are compared and sent with LF.
A field missing from the submission is not changed (a DLQ's form has only its
visibility timeout, the one setting a DLQ has of its own).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Final

from fila.durations import format_ms, parse_ms
from fila.v1 import admin_pb2
from fila.wire import UNLIMITED_ATTEMPTS, parse_max_attempts

# `QueueConfig` field names, which are also the form's field names, in display order.
FIELDS: Final = (
    "visibility_timeout_ms",
    "max_attempts",
    "retry_backoff",
    "on_enqueue_script",
    "on_failure_script",
)
DLQ_FIELDS: Final = ("visibility_timeout_ms",)
SCRIPTS: Final = ("on_enqueue_script", "on_failure_script")
LABELS: Final = {
    "visibility_timeout_ms": "visibility timeout",
    "max_attempts": "max attempts",
    "retry_backoff": "retry backoff",
    "on_enqueue_script": "on_enqueue script",
    "on_failure_script": "on_failure script",
}
# The hidden field holding the digest of what `name` was shown with.
SHOWN_PREFIX: Final = "shown_"


def attempts_text(wire: int) -> str:
    return "unlimited" if wire in (0, UNLIMITED_ATTEMPTS) else str(wire)


def shown_values(config: admin_pb2.QueueConfig) -> dict[str, str]:
    """Each setting as the form shows it."""
    return {
        "visibility_timeout_ms": format_ms(config.visibility_timeout_ms),
        "max_attempts": attempts_text(config.max_attempts),
        "retry_backoff": config.retry_backoff,
        "on_enqueue_script": config.on_enqueue_script,
        "on_failure_script": config.on_failure_script,
    }


def normalized(name: str, value: str) -> str:
    return value.replace("\r\n", "\n") if name in SCRIPTS else value.strip()


def digest(name: str, value: str) -> str:
    return hashlib.sha256(normalized(name, value).encode()).hexdigest()


def digests(values: Mapping[str, str]) -> dict[str, str]:
    return {name: digest(name, value) for name, value in values.items()}


@dataclass(frozen=True, slots=True)
class Changes:
    """The settings to change (None: left as it is), as `Broker.update_queue` takes them."""

    visibility_timeout_ms: int | None = None
    max_attempts: int | None = None
    retry_backoff: str | None = None
    on_enqueue: str | None = None
    on_failure: str | None = None

    def names(self) -> list[str]:
        """The changed settings, in words."""
        wire = {"on_enqueue": "on_enqueue_script", "on_failure": "on_failure_script"}
        return [
            LABELS[wire.get(f.name, f.name)]
            for f in fields(self)
            if getattr(self, f.name) is not None
        ]


def changes(submitted: Mapping[str, str], shown: Mapping[str, str]) -> Changes:
    """The settings whose submitted value differs from the one the form showed
    (`shown`: the digests it carried), parsed; ValueError naming the field otherwise."""
    changed = {
        name: normalized(name, value)
        for name, value in submitted.items()
        if name in FIELDS and digest(name, value) != shown.get(name)
    }
    timeout: int | None = None
    attempts: int | None = None
    try:
        if "visibility_timeout_ms" in changed:
            timeout = parse_ms(changed["visibility_timeout_ms"])
    except ValueError as err:
        raise ValueError(f"Visibility timeout: {err}") from None
    try:
        if "max_attempts" in changed:
            attempts = parse_max_attempts(changed["max_attempts"])
    except ValueError as err:
        raise ValueError(f"Max attempts: {err}") from None
    return Changes(
        visibility_timeout_ms=timeout,
        max_attempts=attempts,
        retry_backoff=changed.get("retry_backoff"),
        on_enqueue=changed.get("on_enqueue_script"),
        on_failure=changed.get("on_failure_script"),
    )
