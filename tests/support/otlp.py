"""An in-test OTLP/gRPC receiver: the collector's MetricsService and TraceService.

It keeps every export request it is sent, so a test can check what a broker pushed
(names, attributes, resource, spans) without running a real collector.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


def attributes(pairs: Any) -> dict[str, object]:
    """OTLP `KeyValue`s as a plain dict (string, int, double and bool values)."""
    out: dict[str, object] = {}
    for kv in pairs:
        value: common_pb2.AnyValue = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = getattr(value, kind) if kind else None
    return out


@dataclass(frozen=True)
class ReceivedMetric:
    resource: dict[str, object]
    scope: str
    metric: metrics_pb2.Metric


class _Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self._sink = sink

    def Export(
        self, request: metrics_service_pb2.ExportMetricsServiceRequest, context: Any
    ) -> metrics_service_pb2.ExportMetricsServiceResponse:
        with self._sink.lock:
            self._sink.metric_requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class _Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self._sink = sink

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        with self._sink.lock:
            self._sink.trace_requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Listens on 127.0.0.1 (a free port) until `stop()`; use as a context manager."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_Metrics(self), self._server)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Traces(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)

    def metrics(self) -> Iterator[ReceivedMetric]:
        """Every metric of every export so far, oldest first."""
        with self.lock:
            requests = list(self.metric_requests)
        for request in requests:
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        yield ReceivedMetric(resource, sm.scope.name, metric)

    def latest(self, name: str) -> ReceivedMetric | None:
        """The most recent export of metric `name`."""
        found = None
        for received in self.metrics():
            if received.metric.name == name:
                found = received
        return found

    def spans(self) -> list[trace_pb2.Span]:
        with self.lock:
            requests = list(self.trace_requests)
        return [
            span
            for request in requests
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]

    def span_resources(self) -> list[dict[str, object]]:
        with self.lock:
            requests = list(self.trace_requests)
        return [attributes(rs.resource.attributes) for r in requests for rs in r.resource_spans]
