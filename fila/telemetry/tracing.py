"""W3C trace context: a server span for each RPC that arrives with a `traceparent`.

Installed only when `[telemetry] otlp_endpoint` is set (spans go there); otherwise the
server has no tracing interceptor at all and pays nothing. With it, a call without
`traceparent` metadata is passed through untouched (a scan of its metadata), and a
call with one gets a SERVER span that is a child of the caller's span, so a producer's
trace shows the broker's Enqueue and a consumer's shows its Ack. The broker does not
start traces of its own: sampling follows the caller's `sampled` flag (a parent-based
sampler whose root decision is "off"), so untraced traffic costs no spans and traced
traffic is recorded exactly when the caller records it.

A span covers the whole call: for Consume and StreamConsume that is the life of the
stream. Health checks and reflection are never traced.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc
from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fila.server.handlers import Handler, behaviour_of, rebuild

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
UNTRACED_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

_PROPAGATOR = TraceContextTextMapPropagator()


def _trace_carrier(metadata: Any) -> dict[str, str] | None:
    """The call's trace context headers, or None if it has no `traceparent`."""
    carrier: dict[str, str] | None = None
    for key, value in metadata or ():
        if key in (TRACEPARENT, TRACESTATE):
            if isinstance(value, bytes):
                value = value.decode("ascii", "replace")
            if carrier is None:
                carrier = {}
            carrier[key] = value
    return carrier if carrier is not None and TRACEPARENT in carrier else None


class TracingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Wraps the handler of each traced call in a server span (see the module doc)."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        carrier = _trace_carrier(handler_call_details.invocation_metadata)
        method = handler_call_details.method
        if handler is None or carrier is None or method.startswith(UNTRACED_PREFIXES):
            return handler
        return self._traced(handler, method, carrier)

    def _traced(self, handler: Handler, method: str, carrier: dict[str, str]) -> Handler:
        service, _, name = method.lstrip("/").partition("/")
        parent = _PROPAGATOR.extract(carrier)
        tracer = self._tracer
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}

        def start(request: Any) -> trace.Span:
            span = tracer.start_span(
                f"{service}/{name}", context=parent, kind=SpanKind.SERVER, attributes=attributes
            )
            queue = getattr(request, "queue", None)
            if isinstance(queue, str) and queue:
                span.set_attribute("messaging.destination.name", queue)
            return span

        behavior = behaviour_of(handler)
        if inspect.isasyncgenfunction(behavior):

            async def traced_stream(request: Any, context: Context) -> AsyncIterator[Any]:
                span = start(request)
                token = context_api.attach(trace.set_span_in_context(span))
                error: BaseException | None = None
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    _finish(span, context, error)
                    context_api.detach(token)

            wrapped: Callable[..., Any] = traced_stream
        else:

            async def traced(request: Any, context: Context) -> Any:
                span = start(request)
                token = context_api.attach(trace.set_span_in_context(span))
                error: BaseException | None = None
                try:
                    return await behavior(request, context)
                except BaseException as exc:
                    error = exc
                    raise
                finally:
                    _finish(span, context, error)
                    context_api.detach(token)

            wrapped = traced
        return rebuild(handler, wrapped)


def _finish(span: trace.Span, context: Context, error: BaseException | None) -> None:
    """Ends `span` with the call's status code: the one the handler set or aborted with,
    else CANCELLED for a call the client cancelled and UNKNOWN for an unexpected error."""
    code = context.code()
    # a StatusCode, an int, or None when the handler set none
    number = code.value[0] if isinstance(code, grpc.StatusCode) else int(code or 0)
    if number == 0 and error is not None:
        cancelled = isinstance(error, asyncio.CancelledError)
        number = (grpc.StatusCode.CANCELLED if cancelled else grpc.StatusCode.UNKNOWN).value[0]
    span.set_attribute("rpc.grpc.status_code", number)
    if number != 0:
        span.set_status(Status(StatusCode.ERROR, context.details() or None))
    span.end()
