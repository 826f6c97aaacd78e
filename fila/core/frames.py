"""Builds the bytes of a `ConsumeResponse` straight from the stored message record.

The stored record is a serialized `fila.v1.Message` that is kept current
(queue, attempt count, fairness metadata). A delivery only adds `leased_at`,
so instead of parsing and re-serializing ~1 KB per delivery we append a tiny
encoded `Message` carrying just that field: protobuf parsers merge repeated
occurrences of a message, so the client sees one message with `leased_at` set.
The consume stream is registered with an identity serializer to send these
bytes as they are.
"""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from fila.v1 import messages_pb2, service_pb2

KEEPALIVE_FRAME = service_pb2.ConsumeResponse().SerializeToString()
_CONSUME_RESPONSE_MESSAGE_TAG = b"\x0a"  # field 1, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def timestamp(ms: int) -> Timestamp:
    return Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def delivery_frame(record: bytes, leased_at_ms: int) -> bytes:
    stamp = messages_pb2.MessageTimestamps(leased_at=timestamp(leased_at_ms))
    body = record + messages_pb2.Message(timestamps=stamp).SerializeToString()
    return _CONSUME_RESPONSE_MESSAGE_TAG + _varint(len(body)) + body
