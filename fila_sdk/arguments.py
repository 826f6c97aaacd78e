"""What `enqueue` accepts, checked once for the blocking and the asyncio client.

Two call shapes are accepted, so that new code reads naturally and code written for
the published SDK keeps working:

    enqueue(queue, payload, *, headers=None, delay=None)     # payload first
    enqueue(queue, headers, payload, *, delay=None)          # the published order

A payload is `bytes` (sent as is) or `str` (sent as UTF-8). A misuse is refused here,
before anything is sent, with an `ArgumentError` in Fila's words; protobuf's own
TypeError ("expected bytes, str found") never reaches the caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from .errors import ArgumentError

UNSET: Final[Any] = object()
JSON_CONTENT_TYPE: Final = "application/json"

Payload = bytes | str


def enqueue_arguments(
    args: tuple[Any, ...], headers: Any, payload: Any
) -> tuple[Mapping[str, str] | None, bytes]:
    """(headers, payload bytes) from `enqueue`'s arguments after the queue."""
    if len(args) > 2:
        raise ArgumentError(
            f"enqueue takes (queue, payload) or (queue, headers, payload), got {len(args) + 1} "
            "positional arguments"
        )
    if len(args) == 2:
        if headers is not UNSET or payload is not UNSET:
            raise ArgumentError("enqueue got headers or payload both by position and by name")
        headers, payload = args
    elif len(args) == 1:
        if payload is UNSET:
            payload = args[0]
        elif headers is UNSET:
            headers = args[0]
        else:
            raise ArgumentError("enqueue got headers or payload both by position and by name")
    elif payload is UNSET:
        raise ArgumentError("enqueue needs a payload: enqueue(queue, payload, headers=...)")
    return checked_headers(None if headers is UNSET else headers), payload_bytes(payload)


def payload_bytes(payload: object, where: str = "") -> bytes:
    """`payload` for the wire: bytes as they are, str as UTF-8."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, str):
        try:
            return payload.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ArgumentError(f"the payload{where} is not valid text: {err.reason}") from None
    if isinstance(payload, bytearray | memoryview):
        return bytes(payload)
    hint = ""
    if isinstance(payload, Mapping):
        hint = " (headers go after the payload, as headers=..., or before it)"
    raise ArgumentError(
        f"the payload{where} must be bytes or str, not {type(payload).__name__}{hint}; "
        "use enqueue_json for other values"
    )


def checked_headers(headers: object, where: str = "") -> Mapping[str, str] | None:
    """`headers` if it is None or a str -> str mapping."""
    if headers is None:
        return None
    if not isinstance(headers, Mapping):
        raise ArgumentError(
            f"the headers{where} must be a mapping of str to str, not {type(headers).__name__}"
        )
    for key, value in headers.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ArgumentError(
                f"the headers{where} must map str to str; header {key!r} is "
                f"{type(key).__name__} -> {type(value).__name__}"
            )
    return headers


def json_arguments(
    value: object, headers: Mapping[str, str] | None
) -> tuple[Mapping[str, str], bytes]:
    """`value` as a compact JSON payload, with `content-type: application/json` unless
    the caller's headers name a content type."""
    try:
        payload = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as err:
        raise ArgumentError(f"enqueue_json: the value is not JSON: {err}") from None
    given = checked_headers(headers) or {}
    if any(key.lower() == "content-type" for key in given):
        return given, payload
    return {**given, "content-type": JSON_CONTENT_TYPE}, payload
