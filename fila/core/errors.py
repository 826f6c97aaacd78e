"""Typed failures of broker operations.

The core raises these; the gRPC edge maps each to a status code and an
`ErrorKind` in exactly one place (`fila.server.status`). Messages name the
offending thing, because they reach the user verbatim, but never echo more than
`MAX_ECHO` characters of it: a 100 KB message id must come back as NOT_FOUND,
not as a status whose metadata is too large for the client to receive.
"""

from __future__ import annotations

from fila.wire import ErrorKind

MAX_ECHO = 120


def clip(text: str, limit: int = MAX_ECHO) -> str:
    """`text` for an error message: at most `limit` characters, marked when cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({len(text)} characters)"


class BrokerError(Exception):
    kind = ErrorKind.INTERNAL


class QueueNotFound(BrokerError):
    kind = ErrorKind.QUEUE_NOT_FOUND

    def __init__(self, queue: str) -> None:
        super().__init__(f'queue "{clip(queue)}" not found')


class QueueAlreadyExists(BrokerError):
    kind = ErrorKind.QUEUE_ALREADY_EXISTS

    def __init__(self, queue: str) -> None:
        super().__init__(f'queue "{clip(queue)}" already exists')


class MessageNotFound(BrokerError):
    kind = ErrorKind.MESSAGE_NOT_FOUND

    def __init__(self, queue: str, message_id: str) -> None:
        super().__init__(f'message "{clip(message_id)}" is not leased in queue "{clip(queue)}"')


class ConfigKeyNotFound(BrokerError):
    kind = ErrorKind.CONFIG_KEY_NOT_FOUND

    def __init__(self, key: str) -> None:
        super().__init__(f'config key "{clip(key)}" not found')


class InvalidArgument(BrokerError):
    kind = ErrorKind.INVALID_ARGUMENT


class PermissionDenied(BrokerError):
    kind = ErrorKind.PERMISSION_DENIED


class ResourceExhausted(BrokerError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class Unavailable(BrokerError):
    kind = ErrorKind.UNAVAILABLE


class Unimplemented(BrokerError):
    kind = ErrorKind.UNIMPLEMENTED


class ApiKeyNotFound(BrokerError):
    kind = ErrorKind.API_KEY_NOT_FOUND

    def __init__(self, key_id: str) -> None:
        super().__init__(f'API key "{clip(key_id)}" not found')


class Unauthenticated(BrokerError):
    """The caller's API key is missing, unknown, revoked or expired (never names the key)."""

    kind = ErrorKind.UNAUTHENTICATED
