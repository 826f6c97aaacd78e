"""Wrapping a gRPC method handler: the pieces every interceptor here needs.

Interceptors (auth, tracing, the cluster edge) replace a handler's behaviour with one
that does something first and then calls it. grpc has no "same handler, other
behaviour" constructor, so `rebuild` makes one of the same shape (unary or streaming
on either side) with the same request deserializer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias, cast

import grpc

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


def behaviour_of(handler: Handler) -> Callable[..., Any]:
    """The function `handler` runs, whichever its shape (grpc-stubs types these for the
    sync server; under grpc.aio they are coroutines or async generators)."""
    behaviour = (
        handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    )
    assert behaviour is not None
    return cast(Callable[..., Any], behaviour)


def rebuild(
    handler: Handler,
    behaviour: Callable[..., Any],
    response_serializer: Callable[[Any], bytes] | None = None,
) -> Handler:
    """A handler of `handler`'s shape and request deserializer running `behaviour`, with
    `handler`'s response serializer unless another is given."""
    kwargs: dict[str, Any] = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": response_serializer or handler.response_serializer,
    }
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(behaviour, **kwargs)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(behaviour, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behaviour, **kwargs)
