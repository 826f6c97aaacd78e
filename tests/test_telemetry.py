"""Observability (SPEC 5): metrics over Prometheus and OTLP, trace context, structured logs.

Every broker here is a real `fila-server` process. The metrics tests drive a workload
whose every event is known (enqueues, deliveries, acks, nacks, an expiry, a dead letter,
a redrive, failing and bypassed Lua hooks, a throttled key) and check that each exported
counter equals what was done and each gauge equals what GetStats says at the same
quiet moment. The OTLP tests run a receiver in the test process (`support.otlp`).
"""

from __future__ import annotations

import io
import json
import logging
import re
import socket
import statistics
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families
from support import ServerFactory, wait_until
from support.otlp import OtlpReceiver, attributes
from support.stubs import RPC_TIMEOUT_S, Fila, StreamConsumer, connect

from fila.clock import ManualClock
from fila.config import ConfigError, parse_config
from fila.core.throttle import MAX_COUNTED_KEYS, OTHER_KEYS, Throttles
from fila.telemetry.histogram import FixedHistogram
from fila.telemetry.logs import (
    JsonFormatter,
    LogfmtFormatter,
    QuietLibraries,
    configure_logging,
)
from fila.testing.children import free_port
from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc
from fila_sdk import Client

PROMPT_S = 10.0

ON_ENQUEUE = """
function on_enqueue(msg)
  if msg.headers.boom then error("boom") end
  local throttle_keys = {}
  if msg.headers.tk then throttle_keys = {msg.headers.tk} end
  return {fairness_key = msg.headers.k or "default", throttle_keys = throttle_keys}
end
"""
ON_FAILURE = """
function on_failure(msg)
  if msg.headers.dlq == "1" then return {action = "dlq"} end
  return {action = "retry"}
end
"""
ALWAYS_FAILS = 'function on_enqueue(msg) error("always") end'

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
GRAFANA_DASHBOARD = DEPLOY / "grafana" / "fila-dashboard.json"
ALERT_RULES = DEPLOY / "prometheus" / "fila-alerts.yml"

COUNTERS = ("enqueued", "delivered", "acked", "nacked", "expired", "dead_lettered", "redriven")


# -- helpers -----------------------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the broker's /metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def sample(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def prometheus_server(factory: ServerFactory, extra: str = "") -> tuple[ServerProcess, int]:
    port = free_port()
    server = factory(config_toml=f'[telemetry]\nprometheus_listen = "127.0.0.1:{port}"\n{extra}')
    return server, port


def set_config(fila: Fila, key: str, value: str) -> None:
    fila.admin.SetConfig(admin_pb2.SetConfigRequest(key=key, value=value), timeout=RPC_TIMEOUT_S)


def traced_metadata(trace_id: int, span_id: int) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{trace_id:032x}-{span_id:016x}-01"),)


def listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on (from /proc: no tools needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = fd.readlink().as_posix()
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


# -- metrics through Prometheus ------------------------------------------------------------


def test_prometheus_counters_equal_the_workload_and_gauges_equal_getstats(
    server_factory: ServerFactory,
) -> None:
    server, port = prometheus_server(
        server_factory,
        "[lua]\ncircuit_breaker_threshold = 2\ncircuit_breaker_cooldown_ms = 600000\n",
    )
    with connect(server.addr) as fila:
        fila.create_queue("jobs", on_enqueue=ON_ENQUEUE, on_failure=ON_FAILURE)
        fila.create_queue("short", visibility_timeout_ms=300)
        fila.create_queue("broken", on_enqueue=ALWAYS_FAILS)
        set_config(fila, "throttle.slow", "0.001,1")  # one token, then one per 1,000 s

        plain = [fila.enqueue("jobs", b"p%d" % i) for i in range(4)]
        to_dlq = fila.enqueue("jobs", b"d", {"dlq": "1"})
        fila.enqueue("jobs", b"b", {"boom": "1"})  # on_enqueue fails: defaults
        with fila.consume("jobs") as jobs:
            first = {m.id: m for m in jobs.take(6)}
            assert to_dlq in first and set(plain) <= set(first)
            for message_id in first:
                if message_id == plain[2]:
                    fila.nack("jobs", message_id, "retry me")
                elif message_id == to_dlq:
                    fila.nack("jobs", message_id, "dead")
                else:
                    fila.ack("jobs", message_id)
            retried = jobs.get()
            assert retried.id == plain[2] and retried.metadata.attempt_count == 1
            fila.ack("jobs", retried.id)
            wait_until(lambda: fila.stats("jobs.dlq").depth == 1, PROMPT_S, what="dead letter")
            redriven = fila.admin.Redrive(
                admin_pb2.RedriveRequest(dlq_queue="jobs.dlq", count=0), timeout=RPC_TIMEOUT_S
            ).redriven
            assert redriven == 1
            back = jobs.get()
            assert back.id == to_dlq and back.metadata.attempt_count == 0
            fila.ack("jobs", back.id)
            # Throttled: the first message takes the only token, the second is held back.
            throttled = [fila.enqueue("jobs", b"t", {"tk": "slow", "k": "t"}) for _ in range(2)]
            got = jobs.get()
            assert got.id == throttled[0]
            fila.ack("jobs", got.id)

            with fila.consume("short") as short:
                short_id = fila.enqueue("short", b"s")
                assert short.get().id == short_id  # not acked: its lease expires
                again = short.get(timeout=5.0)
                assert again.id == short_id and again.metadata.attempt_count == 1
                fila.ack("short", short_id)

                for _ in range(3):  # fails, fails (the breaker opens), bypassed
                    fila.enqueue("broken", b"x")

                expected = {
                    "jobs": dict(
                        enqueued=8, delivered=9, acked=7, nacked=2, expired=0,
                        dead_lettered=1, redriven=1,
                    ),
                    "jobs.dlq": dict.fromkeys(COUNTERS, 0),
                    "short": dict(
                        enqueued=1, delivered=2, acked=1, nacked=0, expired=1,
                        dead_lettered=0, redriven=0,
                    ),
                    "broken": dict.fromkeys(COUNTERS, 0) | {"enqueued": 3},
                }  # fmt: skip

                def settled() -> bool:
                    s = fila.stats("jobs")
                    return s.acked_total == 7 and s.in_flight == 0

                wait_until(settled, PROMPT_S, what="every delivery settled")
                samples = scrape(port)
                stats = {name: fila.stats(name) for name in expected}

    for queue, counts in expected.items():
        for counter, want in counts.items():
            got_value = sample(samples, f"fila_messages_{counter}_total", queue=queue)
            assert got_value == want, (queue, counter, got_value, want)
        # The counters GetStats reports agree with the exported ones.
        for counter in ("enqueued", "delivered", "acked", "nacked", "expired", "dead_lettered"):
            assert getattr(stats[queue], f"{counter}_total") == counts[counter], (queue, counter)

    for queue, st in stats.items():
        gauges = {
            "fila_queue_depth": st.depth,
            "fila_queue_in_flight": st.in_flight,
            "fila_queue_consumers": st.active_consumers,
            "fila_queue_fairness_keys": st.active_fairness_keys,
        }
        for name, want in gauges.items():
            assert sample(samples, name, queue=queue) == want, (queue, name)
    assert stats["jobs"].depth == 1 and stats["jobs"].active_consumers == 1  # the held-back one
    assert stats["broken"].depth == 3

    lua = {
        ("jobs", "on_enqueue", "ok"): 8,
        ("jobs", "on_enqueue", "failed"): 1,
        ("jobs", "on_enqueue", "bypassed"): 0,
        ("jobs", "on_failure", "ok"): 2,
        ("jobs", "on_failure", "failed"): 0,
        ("broken", "on_enqueue", "ok"): 0,
        ("broken", "on_enqueue", "failed"): 2,
        ("broken", "on_enqueue", "bypassed"): 1,
    }
    for (queue, hook, outcome), want in lua.items():
        got_value = sample(
            samples, "fila_lua_executions_total", queue=queue, hook=hook, outcome=outcome
        )
        assert got_value == want, (queue, hook, outcome, got_value)
    assert sample(samples, "fila_throttle_limited_total", throttle_key="slow") == 1

    # Latency: first deliveries only (jobs: six, the redriven one, the throttled one).
    for queue, first_deliveries in (("jobs", 8), ("short", 1), ("broken", 0)):
        count = sample(samples, "fila_delivery_latency_seconds_count", queue=queue)
        assert count == first_deliveries, (queue, count)
        top = sample(samples, "fila_delivery_latency_seconds_bucket", queue=queue, le="+Inf")
        assert top == first_deliveries
    buckets = sorted(
        (float(dict(labels)["le"]), value)
        for (name, labels), value in samples.items()
        if name == "fila_delivery_latency_seconds_bucket" and dict(labels)["queue"] == "jobs"
    )
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    # The redriven message waited in the DLQ before its delivery: its latency is not ~0.
    assert (sample(samples, "fila_delivery_latency_seconds_sum", queue="jobs") or 0) > 0

    fsyncs = sample(samples, "fila_storage_fsync_duration_seconds_count")
    assert fsyncs is not None and fsyncs > 0
    assert sample(samples, "fila_storage_fsync_duration_seconds_bucket", le="+Inf") == fsyncs
    (target,) = [dict(labels) for name, labels in samples if name == "target_info"]
    assert target["service_name"] == "fila" and target["service_version"] == "0.1.0"

    # The shipped dashboard and alert rules use only names the broker serves (the
    # replication gauges, served by cluster nodes only: tests/test_replication.py).
    served = {name for name, _ in samples}
    for shipped in (GRAFANA_DASHBOARD, ALERT_RULES):
        used = set(re.findall(r"\b(?:fila|process)_[a-z_]+", shipped.read_text()))
        used -= {name for name in used if name.startswith("fila_queue_replica")}
        assert used and used <= served, (shipped.name, sorted(used - served))


def test_deleted_queue_leaves_no_series_and_nothing_listens_without_telemetry(
    server_factory: ServerFactory,
) -> None:
    plain = server_factory()
    assert listening_ports(plain.pid) == {plain.port}
    assert "telemetry on" not in plain.log_text()

    server, port = prometheus_server(server_factory)
    assert listening_ports(server.pid) == {server.port, port}
    with connect(server.addr) as fila:
        fila.create_queue("gone")
        fila.enqueue("gone", b"x")
        assert sample(scrape(port), "fila_messages_enqueued_total", queue="gone") == 1
        fila.delete_queue("gone")
        assert not [key for key in scrape(port) if ("queue", "gone") in key[1]]


def test_startup_objects_are_frozen_out_of_full_collections(
    server_factory: ServerFactory,
) -> None:
    """A full collection of the cyclic collector pauses the event loop for as long as
    it takes to visit every tracked object; most were made at startup (measured: 14 ms
    a full collection, 0.8 ms with them frozen). The broker freezes them before it
    serves, and says how many through Prometheus, beside Python's usual GC counters."""
    _, port = prometheus_server(server_factory)
    samples = scrape(port)
    frozen = sample(samples, "python_gc_frozen_objects")
    # a bare interpreter has about 6,000 objects; the broker's imports and server many more
    assert frozen is not None and frozen > 15_000, frozen
    for generation in ("0", "1", "2"):
        assert sample(samples, "python_gc_collections_total", generation=generation) is not None


def test_metrics_include_the_batch_paths(server_factory: ServerFactory) -> None:
    server, port = prometheus_server(server_factory)
    with connect(server.addr) as fila:
        fila.create_queue("bulk")
        batch = service_pb2.EnqueueBatchRequest(
            messages=[service_pb2.EnqueueRequest(queue="bulk", payload=b"x")] * 50
        )
        fila.svc.EnqueueBatch(batch, timeout=RPC_TIMEOUT_S)
        with StreamConsumer(fila.svc, "bulk", max_batch=20, prefetch=100) as stream:
            ids = [m.id for m in stream.take(50)]
            stream.ack(ids)
            wait_until(lambda: fila.stats("bulk").acked_total == 50, PROMPT_S, what="acks")
        samples = scrape(port)
    for counter, want in (("enqueued", 50), ("delivered", 50), ("acked", 50)):
        assert sample(samples, f"fila_messages_{counter}_total", queue="bulk") == want
    assert sample(samples, "fila_delivery_latency_seconds_count", queue="bulk") == 50


# -- OTLP: metrics, traces, a collector that is down ----------------------------------------


def test_otlp_metrics_arrive_with_names_attributes_and_service_name(
    server_factory: ServerFactory,
) -> None:
    with OtlpReceiver() as receiver:
        server = server_factory(
            config_toml=(
                f'[telemetry]\notlp_endpoint = "{receiver.endpoint}"\n'
                'service_name = "fila-under-test"\nmetrics_interval_ms = 200\n'
            )
        )
        with connect(server.addr) as fila:
            fila.create_queue("otlp", on_enqueue=ALWAYS_FAILS)
            for _ in range(3):
                fila.enqueue("otlp", b"x")
            with fila.consume("otlp") as stream:  # all three are leased to it at once
                fila.ack("otlp", stream.get().id)

            def two_in_flight() -> bool:
                latest = receiver.latest("fila.queue.in_flight")
                return latest is not None and any(
                    p.as_int == 2 and attributes(p.attributes) == {"queue": "otlp"}
                    for p in latest.metric.gauge.data_points
                )

            wait_until(two_in_flight, PROMPT_S, what="fila.queue.in_flight exported")

        names = {received.metric.name for received in receiver.metrics()}
        for counter in COUNTERS:
            assert f"fila.messages.{counter}" in names
        for gauge in ("depth", "in_flight", "consumers", "fairness_keys"):
            assert f"fila.queue.{gauge}" in names
        for name in (
            "fila.lua.executions",
            "fila.delivery.latency",
            "fila.storage.fsync.duration",
        ):
            assert name in names

        enqueued = receiver.latest("fila.messages.enqueued")
        assert enqueued is not None
        assert [(attributes(p.attributes), p.as_int) for p in enqueued.metric.sum.data_points] == [
            ({"queue": "otlp"}, 3),
            ({"queue": "otlp.dlq"}, 0),
        ]
        assert enqueued.resource["service.name"] == "fila-under-test"
        assert enqueued.scope == "fila"
        assert enqueued.metric.sum.is_monotonic
        depth = receiver.latest("fila.queue.depth")
        assert depth is not None
        assert {
            (attributes(p.attributes)["queue"], p.as_int) for p in depth.metric.gauge.data_points
        } >= {("otlp", 0), ("otlp.dlq", 0)}
        lua = receiver.latest("fila.lua.executions")
        assert lua is not None
        outcomes = {
            tuple(sorted(attributes(p.attributes).items())): p.as_int
            for p in lua.metric.sum.data_points
        }
        key = (("hook", "on_enqueue"), ("outcome", "failed"), ("queue", "otlp"))
        assert outcomes[key] == 3
        latency = receiver.latest("fila.delivery.latency")
        assert latency is not None and latency.metric.unit == "s"
        point = next(
            p
            for p in latency.metric.histogram.data_points
            if attributes(p.attributes) == {"queue": "otlp"}
        )
        assert point.count == 3 and sum(point.bucket_counts) == 3
        assert list(point.explicit_bounds)[:3] == [0.001, 0.002, 0.005]


def test_traceparent_makes_the_broker_span_join_the_callers_trace(
    server_factory: ServerFactory,
) -> None:
    trace_id, parent_id = 0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331
    with OtlpReceiver() as receiver:
        server = server_factory(
            config_toml=f'[telemetry]\notlp_endpoint = "{receiver.endpoint}"\n'
            'service_name = "fila-traced"\n'
        )
        with connect(server.addr) as fila:
            fila.create_queue("traced")
            fila.svc.Enqueue(
                service_pb2.EnqueueRequest(queue="traced", payload=b"x"),
                metadata=traced_metadata(trace_id, parent_id),
                timeout=RPC_TIMEOUT_S,
            )
            fila.enqueue("traced", b"untraced")  # no traceparent: no span
            unsampled = (("traceparent", f"00-{trace_id + 1:032x}-{parent_id:016x}-00"),)
            fila.svc.Enqueue(
                service_pb2.EnqueueRequest(queue="traced", payload=b"x"),
                metadata=unsampled,
                timeout=RPC_TIMEOUT_S,
            )
            # A refused call is traced too, with its status.
            with pytest.raises(grpc.RpcError):
                fila.svc.Enqueue(
                    service_pb2.EnqueueRequest(queue="missing", payload=b"x"),
                    metadata=traced_metadata(trace_id, parent_id + 1),
                    timeout=RPC_TIMEOUT_S,
                )

            # The SDK sends the current span's context when OpenTelemetry is active.
            provider = TracerProvider()
            tracer = provider.get_tracer("test")
            with Client(server.addr) as client, tracer.start_as_current_span("produce") as span:
                client.enqueue("traced", None, b"from the sdk")
                sdk_context = span.get_span_context()
            with Client(server.addr) as client:
                client.enqueue("traced", None, b"no span around this one")
            # A last traced call: spans are exported in the order their calls ended, so
            # once its span is there, a span of any call above would be too.
            last_parent = parent_id + 2
            fila.svc.Enqueue(
                service_pb2.EnqueueRequest(queue="traced", payload=b"last"),
                metadata=traced_metadata(trace_id, last_parent),
                timeout=RPC_TIMEOUT_S,
            )

            def last_exported() -> bool:
                parents = {int.from_bytes(s.parent_span_id, "big") for s in receiver.spans()}
                return last_parent in parents

            wait_until(last_exported, PROMPT_S, what="the last traced call's span exported")
        spans = [
            s for s in receiver.spans() if int.from_bytes(s.parent_span_id, "big") != last_parent
        ]
    assert len(spans) == 3, [(s.name, s.trace_id.hex()) for s in spans]
    by_parent = {int.from_bytes(s.parent_span_id, "big"): s for s in spans}

    ok = by_parent[parent_id]
    assert int.from_bytes(ok.trace_id, "big") == trace_id
    assert ok.name == "fila.v1.FilaService/Enqueue"
    assert ok.kind == SpanKind.SERVER.value + 1  # OTLP numbers kinds from UNSPECIFIED = 0
    attrs = attributes(ok.attributes)
    assert attrs["rpc.system"] == "grpc" and attrs["rpc.method"] == "Enqueue"
    assert attrs["messaging.destination.name"] == "traced"
    assert attrs["rpc.grpc.status_code"] == 0

    refused = by_parent[parent_id + 1]
    assert int.from_bytes(refused.trace_id, "big") == trace_id
    assert (
        attributes(refused.attributes)["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    )
    assert refused.status.code == 2  # ERROR

    from_sdk = by_parent[sdk_context.span_id]
    assert int.from_bytes(from_sdk.trace_id, "big") == sdk_context.trace_id
    assert receiver.span_resources()[0]["service.name"] == "fila-traced"
    assert trace.get_current_span().get_span_context().is_valid is False  # nothing leaked


def _enqueue_latencies(addr: str, count: int) -> list[float]:
    with connect(addr) as fila:
        latencies = []
        for i in range(count):
            started = time.perf_counter()
            fila.svc.Enqueue(
                service_pb2.EnqueueRequest(queue="lat", payload=b"x"),
                metadata=traced_metadata(i + 1, i + 1),
                timeout=RPC_TIMEOUT_S,
            )
            latencies.append(time.perf_counter() - started)
        return latencies


def test_a_collector_that_is_down_neither_slows_the_broker_nor_floods_its_log(
    server_factory: ServerFactory,
) -> None:
    closed = free_port()  # nothing listens there
    # buffer mode: fsync times on a shared disk would drown what is being compared
    down = server_factory(
        config_toml=f'[telemetry]\notlp_endpoint = "http://127.0.0.1:{closed}"\n'
        "metrics_interval_ms = 200\n",
        persist_mode="buffer",
    )
    plain = server_factory(persist_mode="buffer")
    for server in (down, plain):
        with connect(server.addr) as fila:
            fila.create_queue("lat")
    medians: dict[str, list[float]] = {"down": [], "plain": []}
    started = time.monotonic()
    for _ in range(5):  # interleaved, so both see the same machine
        for name, server in (("down", down), ("plain", plain)):
            medians[name].append(statistics.median(_enqueue_latencies(server.addr, 60)))
    while time.monotonic() - started < 4.0:  # at least 20 failed export rounds
        time.sleep(0.2)
    down_median, plain_median = (
        statistics.median(medians["down"]),
        statistics.median(medians["plain"]),
    )
    # Every request was traced (spans pile up for the dead collector): still no slower.
    assert down_median <= plain_median * 1.5 + 0.0005, (down_median, plain_median)

    stop_started = time.monotonic()
    assert down.stop() == 0
    assert time.monotonic() - stop_started < 5.0  # shutdown does not wait on the collector
    lines = [line for line in down.log_text().splitlines() if not line.startswith("--- harness")]
    exporter_lines = [line for line in lines if "opentelemetry" in line]
    # One line per kind of failure per minute (metrics, spans; transient, failed), not
    # one per export attempt (there were more than 20).
    assert len(exporter_lines) <= 6, "\n".join(exporter_lines)
    assert len(lines) <= 20, "\n".join(lines)


# -- logs -------------------------------------------------------------------------------------

LOGFMT_PAIR = re.compile(r'([A-Za-z0-9_.\-]+)=("(?:[^"\\]|\\.)*"|[^\s"]*)(?: |$)')
SECRET_KEY = "sekret-api-key-8c1f2b"
PAYLOAD_MARK = "payload-marker-5e7d"
# A Lua error whose text tries to start a new log line and forge a field.
FORGING_HOOK = 'function on_enqueue(msg) error("x\\nts=forged level=error msg=\\"fake\\"") end'


def parse_logfmt(line: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    position = 0
    for match in LOGFMT_PAIR.finditer(line):
        assert match.start() == position, f"not logfmt at {position}: {line!r}"
        raw = match.group(2)
        fields[match.group(1)] = json.loads(raw) if raw.startswith('"') else raw
        position = match.end()
    assert position == len(line), f"trailing text in {line!r}"
    return fields


@pytest.mark.parametrize("log_format", ["logfmt", "json"])
def test_logs_are_one_parseable_event_per_line_without_payloads_or_keys(
    server_factory: ServerFactory, log_format: str
) -> None:
    server = server_factory(
        config_toml=(
            f'[telemetry]\nlog_format = "{log_format}"\nlog_level = "debug"\n'
            f'[auth]\nbootstrap_apikey = "{SECRET_KEY}"\n'
        )
    )
    auth = (("authorization", f"Bearer {SECRET_KEY}"),)
    with grpc.insecure_channel(server.addr) as channel:
        svc = service_pb2_grpc.FilaServiceStub(channel)
        admin = admin_pb2_grpc.FilaAdminStub(channel)
        config = admin_pb2.QueueConfig(on_enqueue_script=FORGING_HOOK)
        admin.CreateQueue(
            admin_pb2.CreateQueueRequest(name="logs", config=config), metadata=auth, timeout=10
        )
        for _ in range(2):
            svc.Enqueue(
                service_pb2.EnqueueRequest(
                    queue="logs", payload=PAYLOAD_MARK.encode(), headers={"h": PAYLOAD_MARK}
                ),
                metadata=auth,
                timeout=10,
            )
        with pytest.raises(grpc.RpcError):  # a wrong key is refused, and not logged
            svc.Enqueue(
                service_pb2.EnqueueRequest(queue="logs", payload=b"x"),
                metadata=(("authorization", f"Bearer {SECRET_KEY}-wrong"),),
                timeout=10,
            )
        raw = channel.unary_unary(
            "/fila.v1.FilaService/Enqueue",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError):
            raw(b"\xff\xff\xff", metadata=auth, timeout=10)  # undecodable: a warning
        admin.DeleteQueue(admin_pb2.DeleteQueueRequest(queue="logs"), metadata=auth, timeout=10)
    assert server.stop() == 0

    text = server.log_text()
    assert SECRET_KEY not in text
    assert PAYLOAD_MARK not in text
    lines = [line for line in text.splitlines() if not line.startswith("--- harness")]
    events = [json.loads(line) if log_format == "json" else parse_logfmt(line) for line in lines]
    for event in events:
        assert {"ts", "level", "logger", "msg"} <= event.keys(), event
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", event["ts"])
    messages = [event["msg"] for event in events]
    assert "forged" not in {event["ts"] for event in events}
    hook_failures = [e for e in events if e["msg"].startswith("lua hook failed")]
    assert len(hook_failures) == 2 and all("ts=forged" in e["error"] for e in hook_failures)
    assert all(e["msg"] == "lua hook failed" and e["queue"] == "logs" for e in hook_failures)
    created = next(e for e in events if e["msg"] == "queue created")
    assert created["queue"] == "logs" and created["logger"] == "fila.broker"
    listening = next(e for e in events if e["msg"] == "listening")
    assert listening["addr"] == server.addr
    refused = next(e for e in events if e["msg"] == "refused undecodable request")
    assert refused["method"] == "Enqueue" and refused["level"] == "warning"
    assert "queue deleted" in messages and "stopped" in messages


def test_log_level_comes_from_config_and_fila_log_level_overrides_it(
    server_factory: ServerFactory,
) -> None:
    quiet = server_factory(config_toml='[telemetry]\nlog_level = "warning"\n')
    quiet.stop()
    assert "listening" not in quiet.log_text()
    loud = server_factory(
        config_toml='[telemetry]\nlog_level = "warning"\n', env={"FILA_LOG_LEVEL": "info"}
    )
    loud.stop()
    assert "msg=listening" in loud.log_text()


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ('log_level = "verbose"', '"telemetry.log_level"'),
        ('log_format = "xml"', '"telemetry.log_format"'),
        ('prometheus_listen = "9464"', '"telemetry.prometheus_listen"'),
        ('otlp_endpoint = "grpc://collector:4317"', '"telemetry.otlp_endpoint"'),
        ("metrics_interval_ms = 10", '"telemetry.metrics_interval_ms"'),
    ],
)
def test_bad_telemetry_settings_stop_startup_with_one_line(
    server_factory: ServerFactory, toml: str, named: str
) -> None:
    server = server_factory(config_toml=f"[telemetry]\n{toml}\n", start=False)
    with pytest.raises(RuntimeError, match="exited with code 2"):
        server.start(timeout=PROMPT_S)
    lines = [line for line in server.log_text().splitlines() if line.startswith("fila-server:")]
    assert len(lines) == 1 and named in lines[0], lines


def test_a_taken_prometheus_address_stops_startup_with_one_line(
    server_factory: ServerFactory,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = server_factory(
            config_toml=f'[telemetry]\nprometheus_listen = "127.0.0.1:{port}"\n', start=False
        )
        with pytest.raises(RuntimeError, match="exited with code 1"):
            server.start(timeout=PROMPT_S)
    lines = [line for line in server.log_text().splitlines() if line.startswith("fila-server:")]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], lines
    assert "Traceback" not in server.log_text()


# -- in-process units: the parts above, at their edges ----------------------------------------


def test_throttle_refusals_beyond_the_key_cap_fold_into_other() -> None:
    throttles = Throttles(ManualClock())
    for i in range(MAX_COUNTED_KEYS + 5):
        throttles.configure(f"k{i}", 0.001, 1)
        assert throttles.try_take((f"k{i}",))  # the one token
        assert not throttles.try_take((f"k{i}",))
    assert len(throttles.limited) == MAX_COUNTED_KEYS + 1
    assert throttles.limited[OTHER_KEYS] == 5
    assert throttles.limited["k0"] == 1


def test_fixed_histogram_buckets_are_upper_inclusive() -> None:
    histogram = FixedHistogram((1, 5, 10))
    for value in (0, 1, 2, 5, 6, 10, 11, 1000):
        histogram.record(value)
    snap = histogram.snapshot()
    assert snap.counts == [2, 2, 2, 2]
    assert (snap.count, snap.total) == (8, 1035)
    assert FixedHistogram((1,)).snapshot().count == 0


def _record(message: str, **fields: object) -> logging.LogRecord:
    record = logging.LogRecord("fila.test", logging.WARNING, __file__, 1, message, None, None)
    for key, value in fields.items():
        setattr(record, key, value)
    return record


def test_formatters_escape_values_onto_one_line() -> None:
    record = _record('two\nlines " and = signs', queue="q 1", count=3, missing=None)
    line = LogfmtFormatter().format(record)
    assert "\n" not in line
    fields = parse_logfmt(line)
    assert fields["msg"] == 'two\nlines " and = signs'
    assert fields["queue"] == "q 1" and fields["count"] == "3" and "missing" not in fields
    doc = json.loads(JsonFormatter().format(record))
    assert doc["msg"] == 'two\nlines " and = signs' and doc["count"] == 3


def test_library_log_lines_are_rate_limited_per_template() -> None:
    now = [0.0]
    quiet = QuietLibraries(interval_s=60, clock=lambda: now[0])

    def noisy(msg: str) -> logging.LogRecord:
        return logging.LogRecord(
            "opentelemetry.exporter.otlp", logging.WARNING, __file__, 1, msg, None, None
        )

    assert quiet.filter(noisy("retrying"))
    assert not any(quiet.filter(noisy("retrying")) for _ in range(50))
    assert quiet.filter(noisy("failed"))  # another template passes
    broker = logging.LogRecord("fila.broker", logging.WARNING, __file__, 1, "x", None, None)
    assert all(quiet.filter(broker) for _ in range(5))  # the broker's own lines always pass
    now[0] = 61.0
    passed = noisy("retrying")
    assert quiet.filter(passed) and getattr(passed, "suppressed", 0) == 50


def test_grpc_reports_of_undecodable_metadata_never_log_the_value() -> None:
    """grpcio logs a metadata value that is not UTF-8 in full, once per call: with one
    stray byte in `authorization`, an API key. One redacted line per minute instead."""
    out = io.StringIO()
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    configure_logging("info", "logfmt", out)
    try:
        grpc_log = logging.getLogger("grpc._cython.cygrpc")
        for _ in range(100):
            try:
                b"Bearer the-secret-key\xe9".decode()
            except UnicodeDecodeError:
                grpc_log.exception("Invalid encoding on %s", b"Bearer the-secret-key\xe9")
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    text = out.getvalue()
    assert "the-secret-key" not in text and "Traceback" not in text
    (line,) = text.splitlines()
    assert "not valid UTF-8 (value not logged)" in line


@pytest.mark.parametrize(
    ("key", "value", "ok"),
    [
        ("prometheus_listen", "127.0.0.1:9464", True),
        ("prometheus_listen", ":9464", True),
        ("prometheus_listen", "[::1]:9464", True),
        ("prometheus_listen", "localhost", False),
        ("prometheus_listen", "host:0", False),
        ("prometheus_listen", "host:70000", False),
        ("prometheus_listen", "http://host:9464", False),
        ("otlp_endpoint", "http://collector:4317", True),
        ("otlp_endpoint", "https://collector.example:4317/", True),
        ("otlp_endpoint", "collector:4317", True),
        ("otlp_endpoint", "ftp://collector:4317", False),
        ("otlp_endpoint", "http://collector", False),
    ],
)
def test_telemetry_addresses_are_validated_with_the_config(key: str, value: str, ok: bool) -> None:
    text = f'[telemetry]\n{key} = "{value}"\n'
    if ok:
        assert getattr(parse_config(text, "t.toml").telemetry, key) == value
    else:
        with pytest.raises(ConfigError, match=f'"telemetry.{key}"'):
            parse_config(text, "t.toml")
