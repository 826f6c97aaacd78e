"""What an enqueue stores: limit checks and the encoding of a new message record.

The stored record is a serialized `fila.v1.Message`, built by the broker from
fields it parsed and checked, never the bytes a client sent: a client could
otherwise smuggle fields under numbers the request does not use but the record
does (`Message.metadata` is field 4, `EnqueueRequest.delay_ms` too), or data no
limit counts. `EnqueueRequest` shares its field numbers for `headers` (2) and
`payload` (3) with `Message`, so the record starts with protobuf's serialization
of the parsed request after everything else is dropped (unknown fields, `queue`
and `delay_ms`), followed by the id (1), metadata (4) and enqueue time (5),
encoded by hand and cached: most messages of a batch share their queue, fairness
key and millisecond. That keeps the per-message work of a batch to C-level calls
and a few byte concatenations, instead of building and serializing a `Message`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fila.core.errors import InvalidArgument
from fila.core.frames import encoded_timestamp, varint
from fila.lua.hooks import EnqueueDecision
from fila.v1 import service_pb2

_ID_FIELD = b"\x0a\x24"  # Message.id: field 1, 36 bytes
_MAX_CACHED = 4096


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_bytes: int
    max_headers: int
    max_header_bytes: int
    max_delay_ms: int


def check_limits(request: service_pb2.EnqueueRequest, limits: Limits) -> None:
    """Raises InvalidArgument naming the first limit `request` exceeds."""
    size = len(request.payload)
    if size > limits.max_message_bytes:
        raise InvalidArgument(f"payload is {size} bytes, the limit is {limits.max_message_bytes}")
    if request.delay_ms > limits.max_delay_ms:
        raise InvalidArgument(
            f"delay_ms {request.delay_ms} is over the limit of {limits.max_delay_ms}"
        )
    headers = request.headers
    if not headers:
        return
    if len(headers) > limits.max_headers:
        raise InvalidArgument(
            f"message has {len(headers)} headers, the limit is {limits.max_headers}"
        )
    total = sum(len(k.encode()) + len(v.encode()) for k, v in headers.items())
    if total > limits.max_header_bytes:
        raise InvalidArgument(
            f"headers total {total} bytes, the limit is {limits.max_header_bytes}"
        )


def encode_metadata(
    fairness_key: str,
    weight: int,
    throttle_keys: tuple[str, ...],
    attempt_count: int,
    queue: str,
) -> bytes:
    """`Message.metadata` (field 4) with its tag, encoded by hand."""
    parts: list[bytes] = []
    for number, text in ((1, fairness_key),):
        raw = text.encode()
        parts += (bytes([number << 3 | 2]), varint(len(raw)), raw)
    if weight:
        parts += (b"\x10", varint(weight))
    for key in throttle_keys:
        raw = key.encode()
        parts += (b"\x1a", varint(len(raw)), raw)
    if attempt_count:
        parts += (b"\x20", varint(attempt_count))
    raw_queue = queue.encode()
    parts += (b"\x2a", varint(len(raw_queue)), raw_queue)
    body = b"".join(parts)
    return b"\x22" + varint(len(body)) + body


class RecordEncoder:
    """Encodes new message records, caching the parts messages of a batch share."""

    __slots__ = ("_metadata", "_stamp", "_stamp_ms")

    def __init__(self) -> None:
        self._metadata: dict[tuple[str, int, tuple[str, ...], str], bytes] = {}
        self._stamp_ms = -1
        self._stamp = b""

    def encode(
        self,
        request: service_pb2.EnqueueRequest,
        message_id: str,
        decision: EnqueueDecision,
        queue: str,
        now_ms: int,
    ) -> bytes:
        """The record for `request`; clears its `queue`, `delay_ms` and any field this
        broker does not know (read what you need first)."""
        request.DiscardUnknownFields()
        request.ClearField("queue")
        request.ClearField("delay_ms")
        body = request.SerializeToString()
        cache_key = (decision.fairness_key, decision.weight, decision.throttle_keys, queue)
        metadata = self._metadata.get(cache_key)
        if metadata is None:
            if len(self._metadata) >= _MAX_CACHED:
                self._metadata.clear()
            metadata = self._metadata[cache_key] = encode_metadata(*cache_key[:3], 0, queue)
        if now_ms != self._stamp_ms:
            stamp = encoded_timestamp(now_ms)
            inner = b"\x0a" + varint(len(stamp)) + stamp  # MessageTimestamps.enqueued_at = 1
            self._stamp = b"\x2a" + varint(len(inner)) + inner  # Message.timestamps = 5
            self._stamp_ms = now_ms
        return _ID_FIELD + message_id.encode() + body + metadata + self._stamp
