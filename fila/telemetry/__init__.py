"""Observability: metrics, their export (OTLP and Prometheus), trace context, structured logs.

The broker's hot path does not call OpenTelemetry. The core keeps plain counters
(`QueueCounters`, `HookCounters`, throttle refusals) and fixed-bucket histograms
(`histogram.FixedHistogram`), and `metrics.BrokerMetrics` reads them when the OTLP
reader collects: observable instruments for counters and gauges, and histogram points
built from the core's buckets. A Prometheus scrape reads them too, and writes its
text directly (`prometheus`), on a bounded endpoint (`endpoint`). Nothing here runs
unless `[telemetry]` asks for an exporter.

`histogram` is imported by the core and storage, so it must stay free of OpenTelemetry
imports; the other modules are only imported by `fila.server.main`.
"""
