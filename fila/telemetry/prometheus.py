"""The broker's metrics as Prometheus text, written straight from its counters.

The broker used to serve `/metrics` through OpenTelemetry's Prometheus reader: each
scrape ran the SDK's collection (an `Observation` per series, aggregated into
`MetricsData`), the exporter translated that into prometheus_client families (a
`Sample` with its own label dict per line), and prometheus_client formatted the
samples one by one. At thousands of queues a scrape took seconds and hundreds of
megabytes, spread over all three stages, all of it holding the GIL the event loop
needs (figures: docs/benchmarks.md, "Measurements behind design choices").

Here the same counters `BrokerMetrics` reads for OTLP are read once per scrape and
written as lines: each queue's label is escaped once and reused for its 32 lines, and
no object outlives its line. The output is what that pipeline produced, byte for byte,
in every format prometheus_client negotiates (tests/test_telemetry_prometheus.py
compares the two), so dashboards and alerts see the same names, labels and values.
prometheus_client still chooses the format from `Accept`, names metrics and labels
under the scheme the scraper asked for, and writes the small families it owns
(process, GC, `target_info`); only the per-queue families are written here.

A family with no series is left out, as OpenTelemetry left it out (no queue has a
Lua hook: no `fila_lua_executions_total`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import InfoMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from fila.core.queue import Queue
from fila.telemetry.histogram import FixedHistogram, HistogramSnapshot
from fila.telemetry.metrics import (
    DELIVERY_LATENCY,
    DELIVERY_LATENCY_HELP,
    FSYNC_DURATION,
    FSYNC_DURATION_HELP,
    LOOP_LAG,
    LOOP_LAG_HELP,
    LUA_EXECUTIONS,
    LUA_EXECUTIONS_HELP,
    MESSAGE_COUNTERS,
    QUARANTINED,
    QUARANTINED_HELP,
    QUEUE_GAUGES,
    REPLICA_LAG,
    REPLICA_LAG_HELP,
    REPLICAS,
    REPLICAS_HELP,
    REPLICAS_IN_SYNC,
    REPLICAS_IN_SYNC_HELP,
    THROTTLE_LIMITED,
    THROTTLE_LIMITED_HELP,
    ReplicaGauge,
    ReplicationState,
)

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

    from fila.core.broker import Broker
    from fila.storage.committer import Committer

_EOF = b"# EOF\n"
CHUNK_LINES = 2048
_ATTRIBUTE_KEY = re.compile(r"[^a-zA-Z0-9]+")


@dataclass(frozen=True, slots=True)
class Format:
    """One exposition format, as prometheus_client negotiated it from `Accept`."""

    encoder: Callable[[Collector], bytes]
    content_type: str
    openmetrics: bool
    escaping: str


def negotiate(accept: str | None) -> Format:
    """prometheus_client's choice for `accept` (text 0.0.4 when absent or unknown),
    with what the per-queue writer needs to follow it."""
    encoder, content_type = choose_encoder(accept or "")
    func = getattr(encoder, "func", encoder)
    keywords: dict[str, str] = getattr(encoder, "keywords", {})
    return Format(
        encoder,
        content_type,
        func is openmetrics.generate_latest,
        keywords.get("escaping", openmetrics.UNDERSCORES),
    )


class TargetInfo(Collector):
    """`target_info`: the OpenTelemetry resource (service name and version, SDK), as
    OpenTelemetry's exporter wrote it (attribute keys with `.` turned into `_`)."""

    def __init__(self, resource: Resource) -> None:
        labels = {}
        for key, value in resource.attributes.items():
            if key and key[0].isdigit():
                key = "_" + key[1:]
            labels[_ATTRIBUTE_KEY.sub("_", key)] = str(value)
        self._labels = labels

    def collect(self) -> Iterator[InfoMetricFamily]:
        yield InfoMetricFamily("target", "Target metadata", value=self._labels)


def _label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _float(value: float) -> str:
    """A sample value as prometheus_client writes it (Go's formatting)."""
    text: str = floatToGoString(value)  # type: ignore[no-untyped-call]
    return text


def _count(value: int) -> str:
    """`_float` for a count, without its float round trip in the common case (Go's
    formatting switches to an exponent from 1e6 up)."""
    return f"{value}.0" if type(value) is int and 0 <= value < 1_000_000 else _float(value)


class _Writer:
    """Lines of one format and naming scheme, encoded in chunks of `CHUNK_LINES`.

    Chunks bound what is held at once (the lines of one chunk, not of a family of
    200,000) and how long the GIL is held without a break: joining and encoding a
    whole family was one long call, and the event loop waited behind it."""

    def __init__(self, fmt: Format) -> None:
        self.openmetrics = fmt.openmetrics
        self.escaping = fmt.escaping
        self.chunks: list[bytes] = []
        self._header = ""

    def name(self, name: str) -> str:
        return openmetrics.escape_metric_name(name, self.escaping)

    def label(self, name: str) -> str:
        return openmetrics.escape_label_name(name, self.escaping)

    def family(self, name: str, kind: str, help_text: str, unit: str = "") -> None:
        """Starts a family; its header goes out with its first line, so a family
        without lines leaves no trace."""
        # The text format names a counter family by its sample (`_total`); OpenMetrics
        # by its stem, and adds the unit.
        family = self.name(name + "_total" if kind == "counter" and not self.openmetrics else name)
        help_text = help_text.replace("\\", r"\\").replace("\n", r"\n")
        if self.openmetrics:
            help_text = help_text.replace('"', r"\"")
        self._header = f"# HELP {family} {help_text}\n# TYPE {family} {kind}\n"
        if unit and self.openmetrics:
            self._header += f"# UNIT {family} {unit}\n"

    def lines(self, lines: list[str]) -> None:
        if not lines:
            return
        if self._header:
            lines[0] = self._header + lines[0]
            self._header = ""
        for start in range(0, len(lines), CHUNK_LINES):
            self.chunks.append("".join(lines[start : start + CHUNK_LINES]).encode())


class PrometheusExposition:
    """Renders `/metrics`: prometheus_client's registry (process, GC, `target_info`)
    followed by the broker's families, in the negotiated format."""

    def __init__(
        self,
        broker: Broker,
        committer: Committer,
        registry: CollectorRegistry,
        loop_lag: FixedHistogram,
        replication: ReplicationState | None = None,
    ) -> None:
        self._broker = broker
        self._committer = committer
        self._registry = registry
        self._loop_lag = loop_lag
        self._replication = replication
        self._bounds: dict[tuple[tuple[float, ...], float, str], list[str]] = {}

    def render(self, fmt: Format) -> list[bytes]:
        """The body, in chunks to be sent in order."""
        head = fmt.encoder(self._registry)
        if fmt.openmetrics and head.endswith(_EOF):  # the broker's families go before it
            head = head[: -len(_EOF)]
        out = _Writer(fmt)
        out.chunks.append(head)
        self._write(out)
        if fmt.openmetrics:
            out.chunks.append(_EOF)
        return out.chunks

    def _write(self, out: _Writer) -> None:
        # One copy of the queue map per scrape (a single C-level call: atomic under
        # the GIL, so a queue created meanwhile cannot break the iteration).
        queues: list[Queue] = list(self._broker.queues.values())
        queue_key = out.label("queue")
        labelled = [(q, f'{queue_key}="{_label_value(q.name)}"') for q in queues]

        for name, (field, help_text) in MESSAGE_COUNTERS.items():
            out.family(_prom(name), "counter", help_text)
            sample = out.name(_prom(name) + "_total")
            out.lines(
                [f"{sample}{{{lbl}}} {_count(getattr(q.counters, field))}\n" for q, lbl in labelled]
            )
        for name, (_unit, help_text, read) in QUEUE_GAUGES.items():
            out.family(_prom(name), "gauge", help_text)
            sample = out.name(_prom(name))
            out.lines([f"{sample}{{{lbl}}} {_count(read(q))}\n" for q, lbl in labelled])

        out.family(_prom(LUA_EXECUTIONS), "counter", LUA_EXECUTIONS_HELP)
        sample = out.name(_prom(LUA_EXECUTIONS) + "_total")
        hook_key, outcome_key = out.label("hook"), out.label("outcome")
        lines: list[str] = []
        for queue, lbl in labelled:
            hooks = queue.hooks
            if hooks is None:
                continue
            for hook, counters in hooks.counters().items():
                prefix = f'{sample}{{{hook_key}="{_label_value(hook)}",{outcome_key}="'
                lines.append(f'{prefix}ok",{lbl}}} {_count(counters.ok)}\n')
                lines.append(f'{prefix}failed",{lbl}}} {_count(counters.failed)}\n')
                lines.append(f'{prefix}bypassed",{lbl}}} {_count(counters.bypassed)}\n')
        out.lines(lines)

        out.family(_prom(THROTTLE_LIMITED), "counter", THROTTLE_LIMITED_HELP)
        sample = out.name(_prom(THROTTLE_LIMITED) + "_total")
        key = out.label("throttle_key")
        limited = self._broker.throttles.limited.copy()
        out.lines(
            [f'{sample}{{{key}="{_label_value(k)}"}} {_count(n)}\n' for k, n in limited.items()]
        )

        out.family(_prom(QUARANTINED), "gauge", QUARANTINED_HELP)
        out.lines([f"{out.name(_prom(QUARANTINED))} {_count(self._broker.quarantine.count)}\n"])

        if self._replication is not None:
            self._write_replication(out, self._replication.replica_gauges())

        histogram = self._histogram(out, _prom(DELIVERY_LATENCY) + "_seconds", 1000)
        out.family(
            _prom(DELIVERY_LATENCY) + "_seconds", "histogram", DELIVERY_LATENCY_HELP, "seconds"
        )
        lines = []
        for queue, lbl in labelled:
            histogram(lines, queue.latency.snapshot(), lbl)  # recorded in ms, sent in seconds
            if len(lines) >= CHUNK_LINES:
                out.lines(lines)
                lines = []
        out.lines(lines)

        histogram = self._histogram(out, _prom(FSYNC_DURATION) + "_seconds", 1)
        out.family(_prom(FSYNC_DURATION) + "_seconds", "histogram", FSYNC_DURATION_HELP, "seconds")
        lines = []
        histogram(lines, self._committer.fsync_seconds.snapshot(), "")
        out.lines(lines)

        histogram = self._histogram(out, _prom(LOOP_LAG) + "_seconds", 1)
        out.family(_prom(LOOP_LAG) + "_seconds", "histogram", LOOP_LAG_HELP, "seconds")
        lines = []
        histogram(lines, self._loop_lag.snapshot(), "")
        out.lines(lines)

    def _write_replication(self, out: _Writer, gauges: list[ReplicaGauge]) -> None:
        queue_key, node_key = out.label("queue"), out.label("node")
        labelled = [(g, f'{queue_key}="{_label_value(g.queue)}"') for g in gauges]
        out.family(_prom(REPLICAS), "gauge", REPLICAS_HELP)
        sample = out.name(_prom(REPLICAS))
        out.lines([f"{sample}{{{lbl}}} {_count(g.replicas)}\n" for g, lbl in labelled])
        out.family(_prom(REPLICAS_IN_SYNC), "gauge", REPLICAS_IN_SYNC_HELP)
        sample = out.name(_prom(REPLICAS_IN_SYNC))
        out.lines([f"{sample}{{{lbl}}} {_count(g.in_sync)}\n" for g, lbl in labelled])
        out.family(_prom(REPLICA_LAG), "gauge", REPLICA_LAG_HELP)
        sample = out.name(_prom(REPLICA_LAG))
        out.lines(
            [
                f'{sample}{{{node_key}="{node}",{lbl}}} {_count(lag)}\n'
                for g, lbl in labelled
                for node, lag in sorted(g.lag.items())
            ]
        )

    def _histogram(
        self, out: _Writer, name: str, divisor: float
    ) -> Callable[[list[str], HistogramSnapshot, str], None]:
        """Writes one series of histogram `name`: its `_bucket` lines (cumulative, `le`
        as OpenTelemetry wrote its bounds), then `_count` and `_sum`. `le` sorts before
        every other label, as prometheus_client sorts them."""
        le_key = out.label("le")
        bucket, count, total_name = (out.name(name + end) for end in ("_bucket", "_count", "_sum"))

        def write(lines: list[str], snap: HistogramSnapshot, labels: str) -> None:
            les = self._bounds.get((snap.bounds, divisor, le_key))
            if les is None:
                les = [f'{le_key}="{b / divisor}"' for b in snap.bounds] + [f'{le_key}="+Inf"']
                self._bounds[(snap.bounds, divisor, le_key)] = les
            rest = f",{labels}}} " if labels else "} "
            cumulative = 0
            for le, n in zip(les, snap.counts, strict=True):
                cumulative += n
                lines.append(f"{bucket}{{{le}{rest}{_count(cumulative)}\n")
            braced = f"{{{labels}}}" if labels else ""
            lines.append(f"{count}{braced} {_count(cumulative)}\n")
            lines.append(f"{total_name}{braced} {_float(snap.total / divisor)}\n")

        return write


def _prom(name: str) -> str:
    """An OpenTelemetry instrument name as Prometheus spells it (`.` to `_`)."""
    return name.replace(".", "_")
