"""Builds the bytes of a `ConsumeResponse` straight from stored message records.

The stored record is a serialized `fila.v1.Message` that is kept current (queue,
attempt count, fairness metadata). A delivery only adds `leased_at`, so instead
of parsing and re-serializing ~1 KB per delivery we append a tiny encoded
`Message` carrying just that field: protobuf parsers merge repeated occurrences
of a message, so the client sees one message with `leased_at` set. The consume
streams are registered with an identity serializer to send these bytes as they are.

A stream that asked for `max_batch > 1` gets every frame in the repeated
`messages` field (2), even a frame of one; other streams get `message` (1).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from google.protobuf.timestamp_pb2 import Timestamp

from fila.v1 import service_pb2

KEEPALIVE_FRAME = service_pb2.ConsumeResponse().SerializeToString()
_MESSAGE_TAG = b"\x0a"  # ConsumeResponse.message: field 1, length-delimited
_MESSAGES_TAG = b"\x12"  # ConsumeResponse.messages: field 2, length-delimited


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def timestamp(ms: int) -> Timestamp:
    return Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def encoded_timestamp(ms: int) -> bytes:
    """A `google.protobuf.Timestamp` body (seconds=1, nanos=2), encoded by hand."""
    seconds, millis = divmod(ms, 1000)
    body = b"\x08" + varint(seconds)
    if millis:
        body += b"\x10" + varint(millis * 1_000_000)
    return body


@functools.lru_cache(maxsize=64)
def leased_at_suffix(leased_at_ms: int) -> bytes:
    """An encoded `Message{timestamps{leased_at}}` to append to a stored record; the
    deliveries of one millisecond share it (most frames of a busy stream are)."""
    stamp = encoded_timestamp(leased_at_ms)
    timestamps = b"\x12" + varint(len(stamp)) + stamp  # MessageTimestamps.leased_at = 2
    return b"\x2a" + varint(len(timestamps)) + timestamps  # Message.timestamps = 5


def single_frame(record: bytes, leased_at_ms: int) -> bytes:
    """One frame carrying the record in `message`, copied once."""
    suffix = leased_at_suffix(leased_at_ms)
    return b"".join((_MESSAGE_TAG, varint(len(record) + len(suffix)), record, suffix))


def batch_frame(deliveries: Iterable[tuple[bytes, int]]) -> bytes:
    """One frame carrying every (record, leased_at_ms) in `messages`."""
    parts: list[bytes] = []
    for record, leased_at_ms in deliveries:
        suffix = leased_at_suffix(leased_at_ms)
        parts += (_MESSAGES_TAG, varint(len(record) + len(suffix)), record, suffix)
    return b"".join(parts)
