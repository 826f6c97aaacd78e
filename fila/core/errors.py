"""Typed failures of broker operations.

The core raises these; the gRPC edge maps each to a status code and an
`ErrorKind` in exactly one place (`fila.server.status`). Messages name the
offending thing, because they reach the user verbatim.
"""

from __future__ import annotations

from fila.wire import ErrorKind


class BrokerError(Exception):
    kind = ErrorKind.INTERNAL


class QueueNotFound(BrokerError):
    kind = ErrorKind.QUEUE_NOT_FOUND

    def __init__(self, queue: str) -> None:
        super().__init__(f'queue "{queue}" not found')


class QueueAlreadyExists(BrokerError):
    kind = ErrorKind.QUEUE_ALREADY_EXISTS

    def __init__(self, queue: str) -> None:
        super().__init__(f'queue "{queue}" already exists')


class MessageNotFound(BrokerError):
    kind = ErrorKind.MESSAGE_NOT_FOUND

    def __init__(self, queue: str, message_id: str) -> None:
        super().__init__(f'message "{message_id}" is not leased in queue "{queue}"')


class ConfigKeyNotFound(BrokerError):
    kind = ErrorKind.CONFIG_KEY_NOT_FOUND

    def __init__(self, key: str) -> None:
        super().__init__(f'config key "{key}" not found')


class InvalidArgument(BrokerError):
    kind = ErrorKind.INVALID_ARGUMENT


class ResourceExhausted(BrokerError):
    kind = ErrorKind.RESOURCE_EXHAUSTED


class Unavailable(BrokerError):
    kind = ErrorKind.UNAVAILABLE


class Unimplemented(BrokerError):
    kind = ErrorKind.UNIMPLEMENTED
