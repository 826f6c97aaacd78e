"""Exceptions raised by `fila_sdk`: one class per way a request can fail.

Callers branch on the class, never on message text or status codes, so that
`except QueueNotFoundError` keeps working if the broker rewords a message.
"""

from __future__ import annotations

import grpc

__all__ = [
    "ApiKeyNotFoundError",
    "ArgumentError",
    "BrokerUnreachableError",
    "ClientClosedError",
    "ConfigKeyNotFoundError",
    "DeadlineExceededError",
    "FilaError",
    "InvalidArgumentError",
    "MessageNotFoundError",
    "PermissionDeniedError",
    "QueueAlreadyExistsError",
    "QueueNotFoundError",
    "RPCError",
    "ResourceExhaustedError",
    "UnauthenticatedError",
    "UnavailableError",
]


class FilaError(Exception):
    """Root of every SDK error; `message` is the broker's own wording."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class QueueNotFoundError(FilaError):
    """The queue does not exist."""


class QueueAlreadyExistsError(FilaError):
    """A queue of that name exists already (see `create_queue(exist_ok=True)`)."""


class MessageNotFoundError(FilaError):
    """The id is not leased in that queue: already acked, expired or never delivered."""


class ConfigKeyNotFoundError(FilaError):
    """No runtime configuration value has that key."""


class ApiKeyNotFoundError(FilaError):
    """No API key has that id."""


class InvalidArgumentError(FilaError):
    """The broker refused the request as malformed: a bad name, a script that does
    not compile, a message over the limits, ..."""


class ArgumentError(InvalidArgumentError, TypeError):
    """A call's arguments are of the wrong kind (a payload that is neither bytes nor
    str, headers that are not str -> str); refused by the client before anything is
    sent. Both an `InvalidArgumentError` and a `TypeError`."""

    def __init__(self, message: str) -> None:
        super().__init__(message, grpc.StatusCode.INVALID_ARGUMENT)


class UnauthenticatedError(FilaError):
    """The API key is missing, unknown, revoked or expired."""


class PermissionDeniedError(FilaError):
    """The API key lacks the permission the call needs."""


class ResourceExhaustedError(FilaError):
    """The broker is shedding load; retrying later is the expected reaction."""


class UnavailableError(FilaError):
    """The broker could not be reached or is shutting down."""


class BrokerUnreachableError(UnavailableError):
    """A consumer or `Worker` lost the broker and could not reach it again within the
    client's `reconnect_timeout`; it gave up rather than wait forever."""


class DeadlineExceededError(FilaError):
    """The call did not complete within the client's `timeout`. Whether the broker
    applied it is unknown: an enqueue may have been stored, an ack applied."""


class ClientClosedError(FilaError):
    """The client was used after `close()` (or closed while the call was waiting)."""

    def __init__(self, message: str = "the client is closed") -> None:
        super().__init__(message, grpc.StatusCode.CANCELLED)


class RPCError(FilaError):
    """Any failure without a dedicated class, kept raw for logging."""

    @property
    def details(self) -> str:
        """The broker's message (as `message`)."""
        return self.message
