"""W3C trace context on outgoing calls, when the application uses OpenTelemetry.

The SDK does not require OpenTelemetry. When `opentelemetry-api` is importable and the
calling code is inside a valid span (an OpenTelemetry SDK is configured and tracing),
every call carries that span's context as gRPC metadata, `traceparent` (plus
`tracestate` and `baggage` when present), written by the globally configured
propagator; the broker's span for the call then joins the caller's trace. Otherwise a
call carries nothing extra, and the check is one context-variable read.

Streams take the context current when they open (a `consume` iterator, the producer
stream behind `enqueue`), not the one of each message sent on them.
"""

from __future__ import annotations

try:
    from opentelemetry import propagate, trace
except ImportError:  # OpenTelemetry is optional for SDK users
    _ENABLED = False
else:
    _ENABLED = True

Metadata = tuple[tuple[str, str], ...]


def with_trace_context(metadata: Metadata) -> Metadata:
    """`metadata` plus the current span's trace context headers, if there is a span."""
    if not _ENABLED or not trace.get_current_span().get_span_context().is_valid:
        return metadata
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return metadata
    return metadata + tuple((key.lower(), value) for key, value in carrier.items())
