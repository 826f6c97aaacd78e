"""The one place where broker failures become gRPC statuses.

Every error leaves with a status code, a message naming the offending thing,
and the machine-readable `ErrorKind` in trailing metadata (see `fila.wire`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from fila.core.errors import BrokerError
from fila.storage.store import StorageError
from fila.wire import ERROR_KIND_METADATA_KEY, ErrorKind

log = logging.getLogger("fila.server")

STATUS_BY_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.QUEUE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.MESSAGE_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.CONFIG_KEY_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.API_KEY_NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.QUEUE_ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


async def abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
    if isinstance(exc, BrokerError):
        kind, message = exc.kind, str(exc)
    elif isinstance(exc, StorageError):
        kind, message = ErrorKind.UNAVAILABLE, f"{exc}; the broker is stopping"
    else:
        raise exc
    await context.abort(
        STATUS_BY_KIND[kind], message, trailing_metadata=((ERROR_KIND_METADATA_KEY, kind.value),)
    )


Req = TypeVar("Req")
Resp = TypeVar("Resp")
Handler = Callable[[Any, Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[Resp]]


def unary_errors(handler: Handler[Req, Resp]) -> Handler[Req, Resp]:
    """Turns BrokerError and StorageError raised by a unary handler into its status."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext[Any, Any]) -> Resp:
        try:
            return await handler(self, request, context)
        except (BrokerError, StorageError) as exc:
            await abort(context, exc)

    return wrapper
