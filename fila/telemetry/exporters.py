"""Turning `[telemetry]` into running exporters, and stopping them without delay.

- `prometheus_listen` set: an HTTP endpoint serving Prometheus text at `/metrics`
  (`fila.telemetry.endpoint`, bounded in connections, time and concurrent
  collections), written from the broker's counters by `fila.telemetry.prometheus`
  and prometheus_client's process and GC collectors. A scrape's collection runs on
  the endpoint's threads, one at a time, shared by the scrapes that arrive during it.
- `otlp_endpoint` set: metrics pushed over OTLP/gRPC every `metrics_interval_ms`, and
  the tracing interceptor, whose spans are batched and pushed to the same endpoint.
- either: the loop-lag probe (`fila.telemetry.loop_lag`), a callback on the event
  loop twenty times a second, whose histogram both exporters read.
- neither: no provider, no thread, no socket; the broker behaves as without telemetry.

Every export runs on a thread of its own (the OTLP reader's ticker, the span batcher,
the endpoint's), never on the event loop, so a collector that is slow or down cannot
delay a request: the exporter's retries sleep on its thread, spans that cannot be sent
are dropped once the batcher's bounded queue is full, and the log lines they cause are
rate-limited (`logs.QuietLibraries`). Shutdown gives each exporter a short, bounded
time to send what it holds, then abandons it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider, ObservableCounter, ObservableGauge
from opentelemetry.sdk.metrics.export import MetricsData, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from prometheus_client import CollectorRegistry, GCCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fila import __version__
from fila.config import TelemetrySection
from fila.core.throttle import MAX_COUNTED_KEYS
from fila.telemetry.endpoint import MetricsEndpoint
from fila.telemetry.loop_lag import LoopLag
from fila.telemetry.metrics import SCOPE, BrokerMetrics, ReplicationState, cardinality_limit
from fila.telemetry.prometheus import PrometheusExposition, TargetInfo
from fila.telemetry.tracing import TracingInterceptor

if TYPE_CHECKING:
    from fila.core.broker import Broker
    from fila.storage.committer import Committer

log = logging.getLogger("fila.telemetry")

# How long shutdown waits for each exporter to send what it holds.
SHUTDOWN_TIMEOUT_S = 1.5
# An OTLP export (with its retries) gives up after this long, or the interval if shorter.
EXPORT_TIMEOUT_S = 10.0

Augment = Callable[[MetricsData], MetricsData]


class _FrozenObjects(Collector):
    """`python_gc_frozen_objects`: what the cyclic collector skips
    (`fila.server.startup_heap`), beside prometheus_client's own `python_gc_*`."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "python_gc_frozen_objects",
            "Objects moved out of the cyclic garbage collector's reach at startup",
            value=gc.get_freeze_count(),
        )


class TelemetryStartError(Exception):
    """An exporter could not start (the Prometheus address is taken); worded for operators."""


class _Augmented:
    """Adds the core's histograms to each collection a metric reader receives."""

    _augment: Augment

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        super()._receive_metrics(  # type: ignore[misc]
            self._augment(metrics_data), timeout_millis, **kwargs
        )


class _PeriodicReader(_Augmented, PeriodicExportingMetricReader):
    """The periodic OTLP reader, with the core's histograms added to each collection."""

    def __init__(
        self, augment: Augment, exporter: OTLPMetricExporter, interval_ms: int, limit: int
    ) -> None:
        super().__init__(
            exporter,
            export_interval_millis=interval_ms,
            export_timeout_millis=min(interval_ms, EXPORT_TIMEOUT_S * 1000),
            cardinality_limits={ObservableCounter: limit, ObservableGauge: limit},
        )
        self._augment = augment


def otlp_target(endpoint: str) -> tuple[str, bool]:
    """(endpoint for the exporter, insecure?): `http://` and a bare `host:port` are
    plaintext (a collector beside the broker), `https://` is TLS."""
    return endpoint, not endpoint.startswith("https://")


def split_listen(listen: str) -> tuple[str, int]:
    """`host:port` (validated by the config) as (host, port); an empty host is every
    interface, and IPv6 hosts lose their brackets."""
    host, _, port = listen.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class Telemetry:
    """The exporters `[telemetry]` turned on (`start`), and their shutdown."""

    def __init__(
        self,
        meters: MeterProvider,
        tracer_provider: TracerProvider | None,
        prometheus: MetricsEndpoint | None,
        loop_lag: LoopLag | None = None,
    ) -> None:
        self._meters = meters
        self._tracer_provider = tracer_provider
        self._prometheus = prometheus
        self._loop_lag = loop_lag
        self.interceptors: list[grpc.aio.ServerInterceptor] = []  # type: ignore[type-arg]
        if tracer_provider is not None:
            tracer = tracer_provider.get_tracer(SCOPE, __version__)
            self.interceptors.append(TracingInterceptor(tracer))

    @classmethod
    def start(
        cls,
        section: TelemetrySection,
        broker: Broker,
        committer: Committer,
        max_queues: int,
        replication: ReplicationState | None = None,
    ) -> Telemetry:
        """`replication`: cluster replication's gauges, in cluster mode."""
        resource = Resource.create(
            {SERVICE_NAME: section.service_name, SERVICE_VERSION: __version__}
        )
        loop_lag = LoopLag()
        metrics = BrokerMetrics(broker, committer, loop_lag.seconds, replication)

        def augment(data: MetricsData) -> MetricsData:
            return metrics.with_histograms(data, resource)

        limit = cardinality_limit(max_queues, MAX_COUNTED_KEYS)
        readers: list[PeriodicExportingMetricReader] = []
        exposition = None
        if section.prometheus_listen:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)  # process_cpu_seconds_total, RSS, open fds
            GCCollector(registry=registry)  # python_gc_collections_total by generation
            registry.register(_FrozenObjects())
            registry.register(TargetInfo(resource))
            # Not an OpenTelemetry reader: see fila.telemetry.prometheus for why.
            exposition = PrometheusExposition(
                broker, committer, registry, loop_lag.seconds, replication
            )
        tracer_provider = None
        if section.otlp_endpoint:
            endpoint, insecure = otlp_target(section.otlp_endpoint)
            timeout_s = min(EXPORT_TIMEOUT_S, section.metrics_interval_ms / 1000)
            exporter = OTLPMetricExporter(endpoint=endpoint, insecure=insecure, timeout=timeout_s)
            readers.append(_PeriodicReader(augment, exporter, section.metrics_interval_ms, limit))
            tracer_provider = TracerProvider(
                resource=resource, sampler=ParentBased(ALWAYS_OFF), shutdown_on_exit=False
            )
            spans = OTLPSpanExporter(endpoint=endpoint, insecure=insecure, timeout=EXPORT_TIMEOUT_S)
            tracer_provider.add_span_processor(BatchSpanProcessor(spans))
        meters = MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)
        metrics.register(meters.get_meter(SCOPE, __version__))
        prometheus = None
        if exposition is not None:  # listen only once there is something to collect
            host, port = split_listen(section.prometheus_listen)
            try:
                prometheus = MetricsEndpoint(host, port, exposition.render)
            except OSError as exc:
                cls(meters, tracer_provider, None).shutdown()
                raise TelemetryStartError(
                    f"cannot serve Prometheus metrics on {section.prometheus_listen}: "
                    f"{exc.strerror or exc}; set telemetry.prometheus_listen"
                ) from None
        loop_lag.start(asyncio.get_running_loop())
        return cls(meters, tracer_provider, prometheus, loop_lag)

    def shutdown(self) -> None:
        """Stops every exporter, giving each `SHUTDOWN_TIMEOUT_S` to send what it holds.

        The span batcher's shutdown waits for its last export however long the exporter
        retries, so it runs on a helper thread that is waited for with a timeout and,
        being a daemon, cannot hold the process up past that."""
        if self._loop_lag is not None:
            self._loop_lag.stop()
        if self._prometheus is not None:
            self._prometheus.stop(SHUTDOWN_TIMEOUT_S)
        try:
            self._meters.shutdown(timeout_millis=SHUTDOWN_TIMEOUT_S * 1000)
        except Exception as exc:  # the SDK raises a plain Exception listing its readers
            log.warning("metrics exporters did not stop cleanly", extra={"error": str(exc)})
        if self._tracer_provider is not None:
            stopper = threading.Thread(
                target=self._tracer_provider.shutdown, name="fila-span-shutdown", daemon=True
            )
            stopper.start()
            stopper.join(SHUTDOWN_TIMEOUT_S)
