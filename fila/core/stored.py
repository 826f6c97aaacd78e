"""Stored records read back: the one place that decodes each kind, and checks it.

A message record is a serialized `fila.v1.Message` that the broker built from fields
it parsed and checked (`fila.core.enqueueing.RecordEncoder` for new messages), never
bytes a client sent. Whatever rewrites one (a nack, an expiry, a dead-letter move,
redrive, recovery) goes through `rebuild_message`, which drops fields this broker
does not know before serializing, so nothing a record picked up can travel on.

Every decoder here raises `BadRecord` naming what is wrong, and nothing else: a
message must parse and carry the id its key names (delivery, acks and peek go by
the key); a queue record must be a JSON object whose fields have their types and
whose name is its key's; a config value must be UTF-8; a lease or a delay must have
its fixed size. A record that fails is not the broker's to interpret: it is set
aside (`fila.core.quarantine`), by recovery at startup, by whatever reads it at run
time, and by `fila-server --repair` (`undecodable`), instead of stopping the broker
or being skipped in silence.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import DecodeError

from fila.core.queue import QueueRecord
from fila.core.records import message_id
from fila.storage import keys
from fila.storage.backend import Storage
from fila.v1 import messages_pb2


class BadRecord(Exception):
    """A stored record that does not decode, or does not belong under its key."""


def decode_message(key: bytes, raw: bytes) -> messages_pb2.Message:
    try:
        message = messages_pb2.Message.FromString(raw)
    except (DecodeError, UnicodeDecodeError, ValueError) as exc:
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise BadRecord(f"message record does not decode: {reason}") from None
    expected = message_id(key)
    if message.id != expected:
        raise BadRecord(
            f"message record's id {message.id[:40]!r} is not {expected!r}, the one its key names"
        )
    return message


def rebuild_message(message: messages_pb2.Message) -> bytes:
    """The record for `message`: its known fields only."""
    message.DiscardUnknownFields()
    return message.SerializeToString()


def decode_queue(key: bytes, raw: bytes) -> QueueRecord:
    try:
        record = QueueRecord.decode(raw)
    except (ValueError, TypeError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise BadRecord(f"queue record does not decode: {str(exc)[:200]}") from None
    if keys.queue_key(record.name) != key:
        raise BadRecord(f"queue record names queue {record.name[:80]!r}, not its key's")
    return record


def decode_config(key: bytes, raw: bytes) -> tuple[str, str]:
    """(config key, value)."""
    try:
        return keys.config_name_from_key(key), raw.decode()
    except UnicodeDecodeError:
        raise BadRecord("config record is not UTF-8") from None


def decode_lease(raw: bytes) -> tuple[int, int]:
    """(deadline ms, leased-at ms)."""
    try:
        return keys.decode_lease(raw)
    except ValueError as exc:
        raise BadRecord(str(exc)) from None


def decode_due(raw: bytes) -> int:
    try:
        return keys.decode_due(raw)
    except ValueError as exc:
        raise BadRecord(str(exc)) from None


def undecodable(storage: Storage) -> Iterator[tuple[bytes, bytes, str]]:
    """(key, stored bytes, reason) of every record recovery would set aside."""
    checks = (
        (keys.CONFIG, lambda k, v: decode_config(k, v)),
        (keys.QUEUE, decode_queue),
        (keys.LEASE, lambda _k, v: decode_lease(v)),
        (keys.DELAY, lambda _k, v: decode_due(v)),
        (keys.MESSAGE, decode_message),
    )
    for prefix, check in checks:
        for key, raw in storage.scan(prefix):
            try:
                check(key, raw)
            except BadRecord as exc:
                yield key, raw, str(exc)
