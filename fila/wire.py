"""Wire-level constants shared by the broker's gRPC edge and the clients.

gRPC status codes are too coarse for a client to tell a missing queue from a
missing message on `Ack` (both are `NOT_FOUND`), so every error the broker
returns also carries a machine-readable kind in trailing metadata. Clients that
do not know this key (the published SDKs) still work from the status code alone.
"""

from enum import StrEnum
from typing import Final

ERROR_KIND_METADATA_KEY: Final = "x-fila-error-kind"
# Cluster mode (SPEC 9): where a queue's owner is, on a Consume/StreamConsume refused
# with UNAVAILABLE by another node; the published clients reconnect there.
LEADER_ADDR_METADATA_KEY: Final = "x-fila-leader-addr"
DEFAULT_ADDR: Final = "localhost:5555"
DEFAULT_LISTEN_ADDR: Final = "127.0.0.1:5555"


# A queue dead-letters into its name plus this (SPEC 2). CreateQueue refuses names that
# end in it, so the only way one comes to exist is CreateQueue of the queue it ends in,
# and a name alone says whether a queue is a DLQ and whose: a nack dead-letters by
# name, Redrive's ACL check and the cluster's placement take the source from the
# DLQ's name, and recovery corrects a stored `dlq_of` that disagrees (damage).
DLQ_SUFFIX: Final = ".dlq"


def dlq_name(queue: str) -> str:
    """The dead-letter queue `queue` dead-letters into."""
    return queue + DLQ_SUFFIX


def dlq_owner(name: str) -> str | None:
    """The queue whose dead-letter queue `name` is, or None when it is no queue's."""
    if name.endswith(DLQ_SUFFIX) and len(name) > len(DLQ_SUFFIX):
        return name[: -len(DLQ_SUFFIX)]
    return None


# QueueConfig.max_attempts for "no limit" (0 there means "the broker's default", 25).
UNLIMITED_ATTEMPTS: Final = 2**32 - 1


def parse_max_attempts(text: str) -> int:
    """A `max_attempts` as people write it (a whole number from 1, or `unlimited`) in
    its wire form; ValueError saying what is accepted otherwise."""
    spec = text.strip().lower()
    if spec == "unlimited":
        return UNLIMITED_ATTEMPTS
    if not (spec.isascii() and spec.isdigit()):
        raise ValueError(f'"{text}" is not a number of attempts or "unlimited"')
    count = int(spec)
    if not 1 <= count < UNLIMITED_ATTEMPTS:
        raise ValueError(f"{count} attempts: give at least 1, or unlimited")
    return count


def is_port(text: str) -> bool:
    """A TCP port written in ASCII digits, 1-65535. `str.isdigit` alone also takes
    other scripts' digits (full-width ones, say), which `int` reads but no resolver does."""
    return text.isascii() and text.isdigit() and 0 < int(text) < 65536


class ErrorKind(StrEnum):
    """Why a request failed; the value travels in `ERROR_KIND_METADATA_KEY`."""

    QUEUE_NOT_FOUND = "queue_not_found"
    QUEUE_ALREADY_EXISTS = "queue_already_exists"
    MESSAGE_NOT_FOUND = "message_not_found"
    CONFIG_KEY_NOT_FOUND = "config_key_not_found"
    API_KEY_NOT_FOUND = "api_key_not_found"
    INVALID_ARGUMENT = "invalid_argument"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    UNIMPLEMENTED = "unimplemented"
    INTERNAL = "internal"
