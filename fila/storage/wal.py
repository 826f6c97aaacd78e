"""Reading RocksDB's write-ahead log record by record, for `fila-server --repair`.

Why our own reader: when a WAL record fails its checksum, RocksDB's recovery (in
every mode) drops the rest of its 32 KiB block, because the record's length field
may itself be damaged; its repair drops the rest of the log file. Each of those
bytes may hold answered enqueues and acks. This reader skips only the damaged
bytes: after a bad record it looks for the next offset where a whole record with
a matching CRC32C starts (a false match is a 1 in 2^32 chance per offset) and goes
on from there. What it skips is reported, never guessed at.

The formats, as RocksDB writes them (`db/log_format.h`, `db/write_batch.cc`):

- The log is a sequence of 32 KiB blocks. A record is a 7-byte header (masked
  CRC32C of the type byte and payload, 2-byte length, 1-byte type) and its
  payload; a logical record larger than a block's rest is split into FIRST,
  MIDDLE and LAST fragments; a block's last 0-6 bytes are zero padding.
- Each logical record is one `WriteBatch`: an 8-byte sequence number, a 4-byte
  count, then `count` operations. The broker writes only puts and deletes to the
  default column family; any other operation makes the batch unreadable here (it
  is reported as skipped), rather than applied half understood.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import google_crc32c

BLOCK_BYTES = 32 * 1024
HEADER_BYTES = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4
_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<IHB")
_BATCH_HEADER = struct.Struct("<QI")

# WriteBatch operation tags (db/dbformat.h, ValueType)
_DELETION, _VALUE, _CF_DELETION, _CF_VALUE, _SINGLE_DELETION = 0x0, 0x1, 0x4, 0x5, 0x7
_LOG_DATA, _NOOP = 0x3, 0xD


class BatchError(ValueError):
    """A write batch whose checksum matched but whose contents this reader cannot apply."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One logical WAL record: a write batch, its operations in order.

    An operation is (key, value) for a put and (key, None) for a delete."""

    sequence: int
    operations: list[tuple[bytes, bytes | None]]

    @property
    def last_sequence(self) -> int:
        return self.sequence + max(len(self.operations), 1) - 1


@dataclass(frozen=True, slots=True)
class Skipped:
    """Bytes of the log that did not read back as whole records."""

    offset: int
    bytes: int
    reason: str


def masked_crc(data: bytes) -> int:
    crc: int = google_crc32c.value(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def read_log(data: bytes) -> Iterator[Batch | Skipped]:
    """The write batches of one WAL file in order, and the damaged spans between them."""
    fragments: list[bytes] = []
    fragments_at = 0
    position = 0
    end = len(data)
    while position < end:
        rest_of_block = BLOCK_BYTES - position % BLOCK_BYTES
        if rest_of_block < HEADER_BYTES:  # the block's zero trailer
            position += rest_of_block
            continue
        record = _record_at(data, position)
        if record is None:
            if not any(data[position:]):  # preallocated, never written: the end
                break
            resume = _next_record(data, position + 1)
            if fragments:  # a logical record cut by the damage is lost with it
                yield Skipped(fragments_at, position - fragments_at, "record cut by damage")
                fragments = []
            yield Skipped(position, resume - position, "checksum mismatch")
            position = resume
            continue
        kind, payload = record
        if kind in (_FULL, _FIRST):
            if fragments:
                yield Skipped(fragments_at, position - fragments_at, "record never finished")
            fragments, fragments_at = [payload], position
        elif fragments:
            fragments.append(payload)
        else:  # a MIDDLE or LAST whose start was lost
            yield Skipped(position, HEADER_BYTES + len(payload), "fragment without its start")
            position += HEADER_BYTES + len(payload)
            continue
        position += HEADER_BYTES + len(payload)
        if kind in (_FULL, _LAST):
            whole = b"".join(fragments)
            fragments = []
            try:
                yield parse_batch(whole)
            except BatchError as exc:
                yield Skipped(fragments_at, position - fragments_at, str(exc))
    if fragments:
        yield Skipped(fragments_at, end - fragments_at, "record never finished")


def _record_at(data: bytes, position: int) -> tuple[int, bytes] | None:
    """The (type, payload) of the whole, checksummed record at `position`, else None."""
    if position + HEADER_BYTES > len(data):
        return None
    crc, length, kind = _HEADER.unpack_from(data, position)
    if not _FULL <= kind <= _LAST:
        return None
    start = position + HEADER_BYTES
    if length > BLOCK_BYTES - position % BLOCK_BYTES - HEADER_BYTES or start + length > len(data):
        return None
    if masked_crc(data[position + 6 : start + length]) != crc:
        return None
    return kind, data[start : start + length]


def _next_record(data: bytes, position: int) -> int:
    """The first offset from `position` where a whole record starts, else the end."""
    end = len(data)
    while position < end:
        rest_of_block = BLOCK_BYTES - position % BLOCK_BYTES
        if rest_of_block < HEADER_BYTES:
            position += rest_of_block
            continue
        if _record_at(data, position) is not None:
            return position
        position += 1
    return end


def parse_batch(data: bytes) -> Batch:
    """A write batch's sequence number and operations; BatchError if it holds anything
    but puts and deletes on the default column family, or does not add up."""
    if len(data) < _BATCH_HEADER.size:
        raise BatchError("write batch shorter than its header")
    sequence, count = _BATCH_HEADER.unpack_from(data)
    operations: list[tuple[bytes, bytes | None]] = []
    position = _BATCH_HEADER.size
    while position < len(data):
        tag = data[position]
        position += 1
        if tag in (_CF_VALUE, _CF_DELETION):
            family, position = _varint(data, position)
            if family != 0:
                raise BatchError(f"write batch names column family {family}")
            tag = _VALUE if tag == _CF_VALUE else _DELETION
        if tag == _VALUE:
            key, position = _slice(data, position)
            value, position = _slice(data, position)
            operations.append((key, value))
        elif tag in (_DELETION, _SINGLE_DELETION):
            key, position = _slice(data, position)
            operations.append((key, None))
        elif tag == _LOG_DATA:
            _, position = _slice(data, position)
        elif tag != _NOOP:
            raise BatchError(f"write batch holds an operation of type {tag:#x}")
    if len(operations) != count:
        raise BatchError(f"write batch counts {count} operations but holds {len(operations)}")
    return Batch(sequence, operations)


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(data) or shift > 28:
            raise BatchError("write batch ends inside a length")
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _slice(data: bytes, position: int) -> tuple[bytes, int]:
    length, position = _varint(data, position)
    if position + length > len(data):
        raise BatchError("write batch ends inside a key or value")
    return data[position : position + length], position + length
