"""The broker's metrics (SPEC 5), read from the broker's own counters at collection time.

Nothing here runs on the hot path. Counters and gauges are OpenTelemetry observable
instruments whose callbacks read what the core already counts (`QueueCounters`,
`HookCounters`, `Throttles.limited`, queue sizes) when a reader collects: every
`metrics_interval_ms` for OTLP. Histograms are counted in
fixed buckets by the core (`fila.telemetry.histogram`) and turned into OpenTelemetry
histogram points here, because the SDK has no asynchronous histogram instrument and
recording each delivery into a synchronous one would cost microseconds per message.
`exporters.py` merges those points into each collection (`with_histograms`).

These instruments feed OTLP. The Prometheus endpoint reads the same counters with
the same names and descriptions, but writes its text directly
(`fila.telemetry.prometheus`, which says why). Collection runs on the exporter's
thread (the OTLP reader's, or the endpoint's), not on the event loop. It reads only,
and takes copies of the broker's dictionaries with single C-level calls
(`list(d.values())`, `d.copy()`), which the GIL makes atomic, so a queue created
meanwhile cannot break an iteration. Values read this way may be a moment apart from
each other; monitoring does not need better.

Names, units and attributes are the contract with dashboards and alerts
(docs/operations.md, deploy/grafana/): change them only together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from fila.core.queue import Queue
from fila.telemetry.histogram import FixedHistogram, HistogramSnapshot

if TYPE_CHECKING:
    from fila.core.broker import Broker
    from fila.storage.committer import Committer

# Per-queue event counters: instrument name -> the `QueueCounters` field it reads.
MESSAGE_COUNTERS: dict[str, tuple[str, str]] = {
    "fila.messages.enqueued": ("enqueued", "Messages stored by Enqueue and the batch paths"),
    "fila.messages.delivered": ("delivered", "Messages leased to a consumer (every attempt)"),
    "fila.messages.acked": ("acked", "Messages acknowledged (deleted)"),
    "fila.messages.nacked": ("nacked", "Negative acknowledgements"),
    "fila.messages.expired": (
        "expired",
        "Leases that ended without a settlement (visibility timeout, or a StreamConsume "
        "stream that closed holding the message)",
    ),
    "fila.messages.dead_lettered": ("dead_lettered", "Messages moved to the queue's DLQ"),
    "fila.messages.redriven": ("redriven", "Messages moved back into this queue by Redrive"),
}

# Per-queue gauges: instrument name -> (unit, description, reader).
QUEUE_GAUGES: dict[str, tuple[str, str, Callable[[Queue], int]]] = {
    "fila.queue.depth": (
        "{message}",
        "Ready and delayed messages (GetStats depth)",
        lambda q: q.depth,
    ),
    "fila.queue.in_flight": (
        "{message}",
        "Leased messages awaiting ack, nack or expiry",
        lambda q: len(q.leases),
    ),
    "fila.queue.consumers": (
        "{consumer}",
        "Open Consume and StreamConsume streams",
        lambda q: len(q.consumers),
    ),
    "fila.queue.fairness_keys": (
        "{key}",
        "Fairness keys with ready messages",
        lambda q: len(q.drr.keys),
    ),
}

LUA_EXECUTIONS = "fila.lua.executions"
THROTTLE_LIMITED = "fila.throttle.limited"
DELIVERY_LATENCY = "fila.delivery.latency"
FSYNC_DURATION = "fila.storage.fsync.duration"
QUARANTINED = "fila.storage.quarantined"
LOOP_LAG = "fila.loop.lag"
LUA_OUTCOMES = ("ok", "failed", "bypassed")

# Descriptions shared by the OTLP instruments and the Prometheus exposition
# (`fila.telemetry.prometheus`), which must say the same thing.
LUA_EXECUTIONS_HELP = (
    "Lua hook runs by queue, hook (on_enqueue, on_failure) and outcome "
    "(ok; failed: error, budget or bad result, defaults used; bypassed: circuit "
    "breaker open, defaults used)"
)
THROTTLE_LIMITED_HELP = (
    "Deliveries held back because a throttle key had no token, by that "
    "key (keys past the first 1,000 seen are counted as throttle_key=other)"
)
DELIVERY_LATENCY_HELP = (
    "Time from enqueue to first delivery (from the message id's UUIDv7 "
    "timestamp; includes any delay_ms; retries are not counted)"
)
FSYNC_DURATION_HELP = "Duration of each write-ahead-log fsync"
LOOP_LAG_HELP = (
    "How late the event loop ran a callback due every 50 ms: the time every request "
    "waits behind whatever holds the loop"
)
QUARANTINED_HELP = (
    "Stored records set aside because they do not decode (kept under their own keys, "
    "listed by fila-server --repair)"
)

# Replication (cluster mode), for each replicated queue this node leads.
REPLICAS = "fila.queue.replicas"
REPLICAS_HELP = "Nodes holding a replicated queue (its leader included)"
REPLICAS_IN_SYNC = "fila.queue.replicas.in_sync"
REPLICAS_IN_SYNC_HELP = (
    "Replicas in a replicated queue's in-sync set (its leader included): every "
    "acknowledged write is on each of them; below `fila.queue.replicas`, a follower "
    "lags or is down"
)
REPLICA_LAG = "fila.queue.replica.lag"
REPLICA_LAG_HELP = (
    "Write batches a replica of a replicated queue lacks against its leader, by node "
    "(the follower's acknowledged position)"
)

SCOPE = "fila"


@dataclass(frozen=True, slots=True)
class ReplicaGauge:
    """One replicated queue led by this node, as its gauges read it."""

    queue: str
    replicas: int
    in_sync: int
    lag: dict[int, int] = dataclass_field(default_factory=dict)  # follower -> batches lacked


class ReplicationState(Protocol):
    """Cluster replication's gauges (`fila.cluster.replication`); read on the exporter's
    thread, so it hands out copies."""

    def replica_gauges(self) -> list[ReplicaGauge]: ...


def scope(version: str) -> InstrumentationScope:
    return InstrumentationScope(SCOPE, version)


def cardinality_limit(max_queues: int, max_throttle_keys: int) -> int:
    """Enough series for every queue (and its DLQ) and counted throttle key, so the SDK
    never folds real series into its `otel.metric.overflow` point (its default is 2,000)."""
    return max(2000, 2 * max_queues * len(LUA_OUTCOMES) * 2 + max_throttle_keys + 1)


class BrokerMetrics:
    """The broker's instruments (`register`) and histogram points (`with_histograms`)."""

    def __init__(
        self,
        broker: Broker,
        committer: Committer,
        loop_lag: FixedHistogram,
        replication: ReplicationState | None = None,
    ) -> None:
        self._broker = broker
        self._committer = committer
        self._loop_lag = loop_lag
        self._replication = replication
        self._started_ns = time.time_ns()

    def register(self, meter: Meter) -> None:
        """Creates the observable instruments; their callbacks run at each collection."""
        for name, (field, description) in MESSAGE_COUNTERS.items():
            meter.create_observable_counter(
                name, [self._counter_callback(field)], unit="{message}", description=description
            )
        for name, (unit, description, read) in QUEUE_GAUGES.items():
            meter.create_observable_gauge(
                name, [self._gauge_callback(read)], unit=unit, description=description
            )
        meter.create_observable_counter(
            LUA_EXECUTIONS,
            [self._lua_executions],
            unit="{execution}",
            description=LUA_EXECUTIONS_HELP,
        )
        meter.create_observable_counter(
            THROTTLE_LIMITED,
            [self._throttle_limited],
            unit="{delivery}",
            description=THROTTLE_LIMITED_HELP,
        )
        meter.create_observable_gauge(
            QUARANTINED, [self._quarantined], unit="{record}", description=QUARANTINED_HELP
        )
        if self._replication is not None:
            meter.create_observable_gauge(
                REPLICAS, [self._replicas], unit="{replica}", description=REPLICAS_HELP
            )
            meter.create_observable_gauge(
                REPLICAS_IN_SYNC,
                [self._replicas_in_sync],
                unit="{replica}",
                description=REPLICAS_IN_SYNC_HELP,
            )
            meter.create_observable_gauge(
                REPLICA_LAG, [self._replica_lag], unit="{batch}", description=REPLICA_LAG_HELP
            )

    def _gauges(self) -> list[ReplicaGauge]:
        return self._replication.replica_gauges() if self._replication is not None else []

    def _replicas(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(g.replicas, {"queue": g.queue}) for g in self._gauges()]

    def _replicas_in_sync(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(g.in_sync, {"queue": g.queue}) for g in self._gauges()]

    def _replica_lag(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(lag, {"queue": g.queue, "node": str(node)})
            for g in self._gauges()
            for node, lag in g.lag.items()
        ]

    def _queues(self) -> list[Queue]:
        return list(self._broker.queues.values())

    def _counter_callback(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        read = attrgetter(field)

        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(read(q.counters), {"queue": q.name}) for q in self._queues()]

        return observe

    def _gauge_callback(
        self, read: Callable[[Queue], int]
    ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(read(q), {"queue": q.name}) for q in self._queues()]

        return observe

    def _lua_executions(self, _options: CallbackOptions) -> Iterable[Observation]:
        observations: list[Observation] = []
        for queue in self._queues():
            hooks = queue.hooks
            if hooks is None:
                continue
            for hook, counters in hooks.counters().items():
                base = {"queue": queue.name, "hook": hook}
                observations.append(Observation(counters.ok, {**base, "outcome": "ok"}))
                observations.append(Observation(counters.failed, {**base, "outcome": "failed"}))
                observations.append(Observation(counters.bypassed, {**base, "outcome": "bypassed"}))
        return observations

    def _throttle_limited(self, _options: CallbackOptions) -> Iterable[Observation]:
        limited = self._broker.throttles.limited.copy()
        return [Observation(count, {"throttle_key": key}) for key, count in limited.items()]

    def _quarantined(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._broker.quarantine.count, {})]

    # -- histograms ------------------------------------------------------------------

    def histograms(self) -> list[Metric]:
        """`fila.delivery.latency` per queue, `fila.storage.fsync.duration` and
        `fila.loop.lag`, cumulative."""
        now = time.time_ns()
        started = self._started_ns
        latency = [
            _point(
                queue.latency.snapshot(),
                {"queue": queue.name},
                # A queue deleted and created again starts counting anew.
                max(started, queue.record.created_at_ms * 1_000_000),
                now,
                divisor=1000,  # recorded in ms, exported in seconds
            )
            for queue in self._queues()
        ]
        fsync = [_point(self._committer.fsync_seconds.snapshot(), {}, started, now)]
        lag = [_point(self._loop_lag.snapshot(), {}, started, now)]
        return [
            _histogram(DELIVERY_LATENCY, DELIVERY_LATENCY_HELP, latency),
            _histogram(FSYNC_DURATION, FSYNC_DURATION_HELP, fsync),
            _histogram(LOOP_LAG, LOOP_LAG_HELP, lag),
        ]

    def with_histograms(self, data: MetricsData, resource: Resource) -> MetricsData:
        """`data` (one collection) with the histograms added to Fila's scope."""
        extra = self.histograms()
        resources = list(data.resource_metrics) or [ResourceMetrics(resource, [], "")]
        first = resources[0]
        scopes = list(first.scope_metrics)
        for index, scope_metrics in enumerate(scopes):
            if scope_metrics.scope.name == SCOPE:
                scopes[index] = ScopeMetrics(
                    scope_metrics.scope,
                    [*scope_metrics.metrics, *extra],
                    scope_metrics.schema_url,
                )
                break
        else:
            scopes.append(ScopeMetrics(InstrumentationScope(SCOPE), extra, ""))
        resources[0] = ResourceMetrics(first.resource, scopes, first.schema_url)
        return MetricsData(resources)


def _point(
    snap: HistogramSnapshot,
    attributes: dict[str, str],
    start_ns: int,
    now_ns: int,
    *,
    divisor: float = 1,
) -> HistogramDataPoint:
    return HistogramDataPoint(
        attributes=attributes,
        start_time_unix_nano=start_ns,
        time_unix_nano=now_ns,
        count=snap.count,
        sum=snap.total / divisor,
        bucket_counts=snap.counts,
        explicit_bounds=[bound / divisor for bound in snap.bounds],
        # Not tracked (see fila.telemetry.histogram); None leaves them unset in OTLP.
        min=None,  # type: ignore[arg-type]
        max=None,  # type: ignore[arg-type]
    )


def _histogram(name: str, description: str, points: Sequence[HistogramDataPoint]) -> Metric:
    return Metric(
        name=name,
        description=description,
        unit="s",
        data=Histogram(
            data_points=points, aggregation_temporality=AggregationTemporality.CUMULATIVE
        ),
    )
