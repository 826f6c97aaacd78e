"""The one place where broker failures become gRPC statuses.

Every error leaves with a status code, a message naming the offending thing,
and the machine-readable `ErrorKind` in trailing metadata (see `fila.wire`).
Batch items carry the same three facts in a `BatchError`.

Cluster mode (SPEC 9) adds two shapes: a call answered by another node leaves as
that node answered it (`RemoteError`: its code, message and kind, or no kind when
its transport failed the call), and a consume on a node that does not own the queue
carries the owner's address in `x-fila-leader-addr` (`Redirect`).
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc

from fila.cluster.errors import Redirect, RemoteError
from fila.core.errors import BrokerError
from fila.storage.backend import StorageError
from fila.v1 import service_pb2
from fila.wire import ERROR_KIND_METADATA_KEY, LEADER_ADDR_METADATA_KEY, ErrorKind

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


def kind_and_message(exc: Exception) -> tuple[ErrorKind, str]:
    if isinstance(exc, BrokerError):
        return exc.kind, str(exc)
    if isinstance(exc, StorageError):
        return ErrorKind.UNAVAILABLE, f"{exc}; the broker is stopping"
    raise exc


async def abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
    """Ends the call with `exc`'s status (BrokerError or StorageError; others re-raise)."""
    if isinstance(exc, RemoteError):
        trailers = () if exc.kind_value is None else ((ERROR_KIND_METADATA_KEY, exc.kind_value),)
        await context.abort(exc.code, str(exc), trailing_metadata=trailers)
    kind, message = kind_and_message(exc)
    metadata: tuple[tuple[str, str], ...] = ((ERROR_KIND_METADATA_KEY, kind.value),)
    if isinstance(exc, Redirect):
        metadata += ((LEADER_ADDR_METADATA_KEY, exc.leader_addr),)
    await context.abort(STATUS_BY_KIND[kind], message, trailing_metadata=metadata)


def error_fields(exc: Exception) -> tuple[int, str, str]:
    """What a `BatchError` carries for `exc`: status code number, kind, message."""
    if isinstance(exc, RemoteError):
        return exc.code.value[0], exc.kind_value or "", str(exc)
    kind, message = kind_and_message(exc)
    return STATUS_BY_KIND[kind].value[0], kind.value, message


def batch_error(exc: Exception) -> service_pb2.BatchError:
    code, kind, message = error_fields(exc)
    return service_pb2.BatchError(code=code, kind=kind, message=message)


OK = service_pb2.BatchError()
