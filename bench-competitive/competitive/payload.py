"""Job bodies that carry their own identity.

Every job's payload starts with a 16-byte tag (its index in the cell, zero-padded,
then `|`) and is filled to the requested size. Delivered payloads are read back
through the tag, so the conservation check works the same way for every broker,
whatever ids the broker assigns (Redis and RabbitMQ assign none), and it also
notices a payload that came back truncated or padded.
"""

from __future__ import annotations

from typing import Final

TAG_BYTES: Final = 16
_FILL: Final = b"x"


class PayloadError(ValueError):
    """A delivered payload without a readable tag."""


def make(index: int, size: int) -> bytes:
    """The payload of job `index`, exactly `size` bytes (at least TAG_BYTES)."""
    if size < TAG_BYTES:
        raise ValueError(f"payload size {size} is below the {TAG_BYTES}-byte tag")
    if not 0 <= index < 10**15:
        raise ValueError(f"job index {index} does not fit the tag")
    tag = b"%015d|" % index
    return tag + _FILL * (size - TAG_BYTES)


def index_of(payload: bytes) -> int:
    """The index a payload was made with; PayloadError if it carries no tag."""
    if len(payload) < TAG_BYTES or payload[TAG_BYTES - 1 : TAG_BYTES] != b"|":
        raise PayloadError(f"payload without a tag: {payload[:TAG_BYTES]!r}")
    digits = payload[: TAG_BYTES - 1]
    if not digits.isdigit():
        raise PayloadError(f"payload without a tag: {payload[:TAG_BYTES]!r}")
    return int(digits)
