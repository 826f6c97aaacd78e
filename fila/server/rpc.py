"""How the edge registers RPCs: safe decoding, and errors mapped in one place.

Every method is registered through a generic handler whose request deserializer
never raises. A request that is not valid protobuf (or carries invalid UTF-8 in
a string field) becomes a `BadRequest`, and the handler answers
INVALID_ARGUMENT. Left to grpcio, a deserializer exception ends the call with
UNKNOWN and logs a traceback for every such request, which any peer,
authenticated or not, could use to flood the log; here each cause is logged at
most once per `BadRequestLog` interval, with a count of the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from fila.core.errors import BrokerError, InvalidArgument
from fila.server.status import abort
from fila.storage.backend import StorageError

log = logging.getLogger("fila.server")

Context = grpc.aio.ServicerContext[Any, Any]
Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp")


class BadRequest:
    """What a request that failed to decode becomes; see the module docstring."""

    __slots__ = ("reason", "type_name")

    def __init__(self, type_name: str, reason: str) -> None:
        self.type_name = type_name
        self.reason = reason

    def error(self) -> InvalidArgument:
        return InvalidArgument(f"request is not a valid fila.v1.{self.type_name}: {self.reason}")


class BadRequestLog:
    """Logs each cause of undecodable requests at most once per interval."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self._interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}

    def note(self, method: str, bad: BadRequest) -> None:
        cause = f"{method}: {bad.reason}"
        now = time.monotonic()
        last, suppressed = self._last.get(cause, (-self._interval_s, 0))
        if now - last < self._interval_s:
            self._last[cause] = (last, suppressed + 1)
            return
        if len(self._last) > 1000:
            self._last.clear()
        self._last[cause] = (now, 0)
        log.warning(
            "refused undecodable request",
            extra={
                "method": method,
                "reason": bad.reason[:200],
                "suppressed_since_last": suppressed,
            },
        )


BAD_REQUESTS = BadRequestLog()


def parser(cls: type[Req]) -> Callable[[bytes], Req | BadRequest]:
    """A request deserializer that never raises, and keeps only the fields `cls`
    defines: what a handler stores, forwards to another node or echoes is built from
    parsed fields, never carried along from the client's bytes."""
    name = cls.__name__

    def parse(raw: bytes) -> Req | BadRequest:
        try:
            request = cls.FromString(raw)
        except (DecodeError, UnicodeDecodeError, ValueError) as exc:
            return BadRequest(name, str(exc).splitlines()[0][:200] or type(exc).__name__)
        request.DiscardUnknownFields()
        return request

    return parse


def serializer(message: Message) -> bytes:
    return message.SerializeToString()


def identity(frame: bytes) -> bytes:
    return frame


async def refuse(request: BadRequest, method: str, context: Context) -> NoReturn:
    """Ends the call with INVALID_ARGUMENT for a request that did not decode."""
    BAD_REQUESTS.note(method, request)
    await abort(context, request.error())


async def checked(request: Req | BadRequest, method: str, context: Context) -> Req:
    """`request`, or the call ends with INVALID_ARGUMENT if it did not decode."""
    if isinstance(request, BadRequest):
        await refuse(request, method, context)
    return request


def unary(
    method: str,
    cls: type[Req],
    behavior: Callable[[Req, Context], Awaitable[Resp]],
    *,
    raw_response: bool = False,
) -> grpc.RpcMethodHandler[Any, Any]:
    """`raw_response`: the behaviour answers bytes it encoded itself."""

    async def handle(request: Req | BadRequest, context: Context) -> Resp:
        if isinstance(request, BadRequest):
            await refuse(request, method, context)
        try:
            return await behavior(request, context)
        except (BrokerError, StorageError) as exc:
            await abort(context, exc)

    return grpc.unary_unary_rpc_method_handler(
        handle,
        request_deserializer=parser(cls),
        response_serializer=identity if raw_response else serializer,
    )


def server_stream(
    method: str,
    cls: type[Req],
    behavior: Callable[[Req, Context], Awaitable[None]],
) -> grpc.RpcMethodHandler[Any, Any]:
    async def handle(request: Req | BadRequest, context: Context) -> None:
        if isinstance(request, BadRequest):
            await refuse(request, method, context)
        try:
            await behavior(request, context)
        except (BrokerError, StorageError) as exc:
            await abort(context, exc)
        except Exception:
            if not context.done():
                raise
            _client_gone(method)

    return grpc.unary_stream_rpc_method_handler(
        handle, request_deserializer=parser(cls), response_serializer=identity
    )


def bidi_stream(
    method: str,
    cls: type[Req],
    behavior: Callable[[AsyncIterator[Req | BadRequest], Context], Awaitable[None]],
    *,
    raw_responses: bool = False,
) -> grpc.RpcMethodHandler[Any, Any]:
    async def handle(requests: AsyncIterator[Req | BadRequest], context: Context) -> None:
        try:
            await behavior(requests, context)
        except (BrokerError, StorageError) as exc:
            await abort(context, exc)
        except Exception:
            if not context.done():
                raise
            _client_gone(method)

    return grpc.stream_stream_rpc_method_handler(
        handle,
        request_deserializer=parser(cls),
        response_serializer=identity if raw_responses else serializer,
    )


def _client_gone(method: str) -> None:
    """A stream's write failed because its call had already ended (the client went
    away or cancelled): nobody is left to answer, and gRPC would log the exception
    with its traceback as a servicer error, once per vanished client."""
    log.debug("a stream's call ended under it; its client went away", extra={"method": method})
