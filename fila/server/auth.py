"""Authentication at the edge: one interceptor in front of every RPC.

With `[auth] bootstrap_apikey` set, every call except health checks and
reflection must carry `authorization: Bearer <key>`. This release knows only
the bootstrap key (a superadmin); stored API keys and ACLs plug into
`KeyVerifier` later without touching the services.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeAlias

import grpc

from fila.wire import ERROR_KIND_METADATA_KEY, ErrorKind

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


class KeyVerifier(Protocol):
    def verify(self, presented: str) -> bool: ...


class BootstrapKey:
    def __init__(self, key: str) -> None:
        self._key = key.encode()

    def verify(self, presented: str) -> bool:
        return hmac.compare_digest(self._key, presented.encode())


def _bearer(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return value[len("Bearer ") :].strip()
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self, verifier: KeyVerifier) -> None:
        self._verifier = verifier

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        presented = _bearer(handler_call_details.invocation_metadata)
        if presented is None:
            return _refusal(handler, "missing API key: send authorization: Bearer <key>")
        if not self._verifier.verify(presented):
            return _refusal(handler, "unknown, revoked or expired API key")
        return handler


def _refusal(handler: Handler, message: str) -> Handler:
    async def deny(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            message,
            trailing_metadata=((ERROR_KIND_METADATA_KEY, ErrorKind.UNAUTHENTICATED.value),),
        )

    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
