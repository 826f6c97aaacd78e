"""What a message passes into Lua, and how large it may be.

Every value a hook sees is copied into the queue's Lua state before the call. The
copy happens with the state's memory cap lifted (see sandbox.lua), so its size must
be bounded here instead: a 4 MiB nack error or an operator's very large header
limits must not turn into megabytes of Lua strings per call. Oversized values are
cut at a UTF-8 character boundary and end with a marker naming the original size,
so a script (and whoever reads its output) can tell. (The core already cuts a nack's
error to 4 KiB with the same marker before it calls `on_failure`; this bound is the
sandbox's own guarantee, whatever its caller does.)

Bounds, chosen well above what the broker's defaults let through:
- `msg.error`: 4 KiB. Error text is for humans; a nack may carry a whole stack trace.
- each header name and value: 64 KiB (the broker's default for all headers together).
- all headers together: 256 KiB; headers past that are left out and
  `msg.headers_omitted` says how many.
"""

from __future__ import annotations

from collections.abc import Mapping

ERROR_MAX_BYTES = 4 * 1024
HEADER_STRING_MAX_BYTES = 64 * 1024
HEADERS_MAX_BYTES = 256 * 1024


def marker(original_bytes: int) -> bytes:
    """The same marker as the core's own cut of nack errors."""
    return f"... [truncated, {original_bytes} bytes in all]".encode()


def clip(text: str, limit: int) -> bytes:
    """`text` as UTF-8, at most `limit` bytes including the truncation marker."""
    if len(text) * 4 <= limit:  # cheap test first: a character is at most 4 bytes
        return text.encode("utf-8", "replace")
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return data
    tail = marker(len(data))
    head = data[: limit - len(tail)].decode("utf-8", "ignore").encode()
    return head + tail


def header_args(headers: Mapping[str, str]) -> list[int | bytes]:
    """[omitted, name1, value1, name2, value2, ...] for the sandbox's entry points."""
    args: list[int | bytes] = [0]
    total = 0
    for count, (name, value) in enumerate(headers.items()):
        k = clip(name, HEADER_STRING_MAX_BYTES)
        v = clip(value, HEADER_STRING_MAX_BYTES)
        total += len(k) + len(v)
        if total > HEADERS_MAX_BYTES:
            args[0] = len(headers) - count
            break
        args.append(k)
        args.append(v)
    return args
