"""The Prometheus endpoint under load and abuse, and its exposition against OpenTelemetry's.

`/metrics` is written straight from the broker's counters (`fila.telemetry.prometheus`)
and served by a bounded endpoint (`fila.telemetry.endpoint`). The first tests pin the
text to what OpenTelemetry's Prometheus exporter wrote from the same counters, byte for
byte, in every format prometheus_client negotiates, so dashboards and alerts see the
same series. The others check the bounds with real brokers and real sockets:
connections whose request has not arrived cost no thread and hold no slot (silent
ones cannot lock a scraper out), a cap on requests being answered, a deadline for
request heads, no collection for a request that never completed or whose client left,
one collection shared by concurrent scrapes, and a shutdown that does not wait for
clients. What a
scrape costs is a measurement, printed by `scripts/telemetry_overhead.py --micro`
(the direct exposition beside OpenTelemetry's pipeline), not a timed test.
"""

from __future__ import annotations

import asyncio
import gzip
import os
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider, ObservableCounter, ObservableGauge
from opentelemetry.sdk.metrics.export import MetricsData
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from support import ServerFactory, wait_until
from support.core import CoreBroker, make_core
from test_telemetry import PROMPT_S, prometheus_server, sample, scrape

from fila.telemetry.endpoint import (
    MAX_CONNECTIONS,
    MAX_WAITING,
    REQUEST_TIMEOUT_S,
    MetricsEndpoint,
)
from fila.telemetry.histogram import LOOP_LAG_BOUNDS_S, FixedHistogram
from fila.telemetry.metrics import SCOPE, BrokerMetrics
from fila.telemetry.prometheus import Format, PrometheusExposition, TargetInfo, negotiate
from fila.v1 import admin_pb2, admin_pb2_grpc

ON_ENQUEUE = 'function on_enqueue(msg) return {fairness_key = "k"} end'
ON_FAILURE = 'function on_failure(msg) return {action = "retry"} end'
BUFFERED = '[storage]\npersist_mode = "buffer"\n'  # no fsync per queue created
# Silent connections kept open against one broker: well beyond its slots.
SILENT_FLOOD = MAX_WAITING + MAX_CONNECTIONS
SCRAPE_S = 3.0  # how long a scrape may take with them (Prometheus' default timeout: 10 s)
OPENMETRICS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;q=0.5,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.1"  # what Prometheus sends
)

# -- the exposition: what OpenTelemetry's exporter wrote ---------------------------------------


class _OpenTelemetryReader(PrometheusMetricReader):
    """The pipeline `/metrics` used to run, as the reference: the SDK's collection of
    `BrokerMetrics`' instruments, with the core's histograms added, translated by
    OpenTelemetry's Prometheus exporter."""

    def __init__(self, metrics: BrokerMetrics, resource: Resource, registry: Any) -> None:
        super().__init__(
            scope_info_enabled=False,
            registry=registry,
            cardinality_limits={ObservableCounter: 100_000, ObservableGauge: 100_000},
        )
        self._broker_metrics, self._resource = metrics, resource

    def _receive_metrics(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any
    ) -> None:
        augmented = self._broker_metrics.with_histograms(metrics_data, self._resource)
        super()._receive_metrics(augmented, timeout_millis, **kwargs)


class _Both:
    """One in-process broker exposed both ways."""

    def __init__(self, core: CoreBroker, loop_lag: FixedHistogram) -> None:
        resource = Resource.create({"service.name": "fila", "service.version": "0.1.0"})
        metrics = BrokerMetrics(core.broker, core.committer, loop_lag)
        self.reference = CollectorRegistry()
        self._provider = MeterProvider(
            resource=resource,
            metric_readers=[_OpenTelemetryReader(metrics, resource, self.reference)],
            shutdown_on_exit=False,
        )
        metrics.register(self._provider.get_meter(SCOPE))
        registry = CollectorRegistry()
        registry.register(TargetInfo(resource))
        self.exposition = PrometheusExposition(core.broker, core.committer, registry, loop_lag)

    def close(self) -> None:
        self._provider.shutdown()


@pytest.fixture
def workload() -> Iterator[_Both]:
    """Queues with and without hooks (and their DLQs), every counter distinct, counts
    past a million (Go's exponent form), latencies in every bucket, throttle keys
    that need escaping, fsync times."""

    async def build() -> CoreBroker:
        core = make_core(queues=[f"plain-{i}" for i in range(5)])
        core.broker.create_queue("hooked", ON_ENQUEUE, ON_FAILURE, 1000)
        core.broker.create_queue("enqueue-only:x", ON_ENQUEUE, "", 1000)
        return core

    core = asyncio.run(build())
    for i, queue in enumerate(core.broker.queues.values()):
        for j, field in enumerate(("enqueued", "delivered", "acked", "nacked", "expired")):
            setattr(queue.counters, field, i * 10 + j)
        queue.counters.dead_lettered, queue.counters.redriven = 1_234_567 + i, 10**12 + i
        for value in (0, 1, 3, 7, 30, 70, 300, 700, 4000, 10**5, 10**7, i):
            queue.latency.record(value)
        if queue.hooks is not None:
            for k, counters in enumerate(queue.hooks.counters().values()):
                counters.ok, counters.failed, counters.bypassed = 5 + k, 2_000_000, k
    core.broker.throttles.limited.update({"slow": 3, 'we"ird\\key\nx': 2_500_000, "": 1})
    for seconds in (0.00003, 0.0004, 0.02, 3.5, 99.0):
        core.committer.fsync_seconds.record(seconds)
    loop_lag = FixedHistogram(LOOP_LAG_BOUNDS_S)
    for seconds in (0.0, 0.0007, 0.003, 0.06, 0.3, 7.0, 120.0):
        loop_lag.record(seconds)
    both = _Both(core, loop_lag)
    yield both
    both.close()


@pytest.mark.parametrize(
    "accept",
    [
        None,  # text 0.0.4: curl, urllib
        OPENMETRICS_ACCEPT,
        "application/openmetrics-text",
        "application/openmetrics-text;version=1.0.0;escaping=dots",
        "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
        "text/plain;version=1.0.0;escaping=allow-utf-8",
        "text/plain;version=1.0.0;escaping=dots",
        "text/plain;version=1.0.0;escaping=values",
        # Not compared: OpenMetrics with escaping=values, where prometheus_client's own
        # writer names samples differently from their families (`U__` on samples only).
    ],
)
def test_exposition_is_what_opentelemetrys_exporter_wrote(
    workload: _Both, accept: str | None
) -> None:
    fmt = negotiate(accept)
    want = fmt.encoder(workload.reference)
    got = b"".join(workload.exposition.render(fmt))
    assert got.decode() == want.decode()
    if accept is None:  # every family and kind of line is there to be compared
        for part in (b"fila_lua_executions_", b"fila_throttle_limited_", b"e+06", b"e+12"):
            assert part in got, part
        assert b'le="+Inf",queue="hooked"} 12.0' in got
        assert b"fila_storage_fsync_duration_seconds_count 5.0" in got


# -- the endpoint, in process: what each request costs -------------------------------------


class _Gate:
    """A render function that counts its calls and, when closed, blocks until opened."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.opened.set()

    def __call__(self, fmt: Format) -> list[bytes]:
        self.calls += 1
        self.entered.set()
        self.opened.wait(PROMPT_S)
        return [b"# call %d\n" % self.calls, b"x 1.0\n"]


@pytest.fixture
def endpoint() -> Iterator[tuple[MetricsEndpoint, _Gate]]:
    gate = _Gate()
    served = MetricsEndpoint("127.0.0.1", 0, gate)
    yield served, gate
    gate.opened.set()
    served.stop(2.0)


def _get(
    port: int, headers: dict[str, str] | None = None, timeout: float = PROMPT_S
) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_concurrent_scrapes_share_one_collection(
    endpoint: tuple[MetricsEndpoint, _Gate],
) -> None:
    served, gate = endpoint
    gate.opened.clear()
    replies: list[tuple[int, bytes]] = []
    scrapers = [
        threading.Thread(target=lambda: replies.append(_get(served.port))) for _ in range(6)
    ]
    scrapers[0].start()
    assert gate.entered.wait(PROMPT_S)  # the first one is collecting
    for scraper in scrapers[1:]:
        scraper.start()
    wait_until(lambda: served.renders.waiting == 5, PROMPT_S, what="five scrapes waiting")
    gate.opened.set()
    for scraper in scrapers:
        scraper.join(PROMPT_S)
    assert replies == [(200, b"# call 1\nx 1.0\n")] * 6 and gate.calls == 1
    # One that arrives after the collection finished gets a fresh one.
    assert _get(served.port) == (200, b"# call 2\nx 1.0\n")


def test_requests_that_never_completed_cost_no_collection(
    endpoint: tuple[MetricsEndpoint, _Gate],
) -> None:
    """A client that closes before the blank line ending its headers (half-sent
    requests left by a timed-out or killed scraper, slowloris clients that give up),
    or that closes right after a complete request, gets no collection: before, each
    such connection ran a full one for nobody, and SIGTERM waited behind a thousand."""
    served, gate = endpoint
    for head in (b"GET /metrics HTTP/1.1\r\n", b"GET /metrics HTTP/1.1\r\nHost: x\r\n", b"GE"):
        with socket.create_connection(("127.0.0.1", served.port)) as client:
            client.sendall(head)
    with socket.create_connection(("127.0.0.1", served.port)) as client:
        # Corked, the request and the FIN leave in one segment, so the broker sees
        # them together: a complete request whose client has already left.
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        client.shutdown(socket.SHUT_WR)
    wait_until(lambda: served.finished == 4, PROMPT_S, what="every connection handled")
    assert gate.calls == 0
    assert _get(served.port)[0] == 200 and gate.calls == 1


def test_complete_requests_hold_the_slots_and_one_more_is_refused(
    endpoint: tuple[MetricsEndpoint, _Gate],
) -> None:
    """Only a request that has arrived takes a slot (and a thread) to be answered; when
    every slot is held, one more is answered 503 at once by the accepting thread."""
    served, gate = endpoint
    gate.opened.clear()
    replies: list[tuple[int, bytes]] = []
    scrapers = [
        threading.Thread(target=lambda: replies.append(_get(served.port)))
        for _ in range(MAX_CONNECTIONS)
    ]
    for scraper in scrapers:
        scraper.start()
    wait_until(
        lambda: served.renders.waiting == MAX_CONNECTIONS - 1,
        PROMPT_S,
        what="every slot held by a request waiting for the collection",
    )
    assert served.connections == MAX_CONNECTIONS
    assert _get(served.port) == (503, b"too many connections\r\n")
    gate.opened.set()
    for scraper in scrapers:
        scraper.join(PROMPT_S)
    assert replies == [(200, b"# call 1\nx 1.0\n")] * MAX_CONNECTIONS


def test_gzip_and_head_and_a_bad_request(endpoint: tuple[MetricsEndpoint, _Gate]) -> None:
    served, _ = endpoint
    status, body = _get(served.port, {"Accept-Encoding": "gzip"})
    assert status == 200 and gzip.decompress(body) == b"# call 1\nx 1.0\n"
    head = urllib.request.Request(f"http://127.0.0.1:{served.port}/metrics", method="HEAD")
    with urllib.request.urlopen(head, timeout=PROMPT_S) as reply:
        assert reply.headers["Content-Length"] == str(len(b"# call 2\nx 1.0\n"))
    with socket.create_connection(("127.0.0.1", served.port), timeout=PROMPT_S) as client:
        client.sendall(b"BREW /metrics HTTP/1.1\r\n\r\n")
        assert client.recv(100).startswith(b"HTTP/1.0 501")


# -- real brokers: the bounds as operators meet them ---------------------------------------


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _closed_by_peer(socks: list[socket.socket], within: float) -> list[socket.socket]:
    """Those of `socks` the other end closes (EOF or reset, after any reply) within
    `within` seconds, waiting until all of them are or the time is up."""
    closed: list[socket.socket] = []
    deadline = time.monotonic() + within
    while len(closed) < len(socks) and (remaining := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [], remaining)
        for sock in readable:
            try:
                if not sock.recv(4096):
                    closed.append(sock)
            except ConnectionResetError:
                closed.append(sock)
    return closed


def _scrape_until_closed(port: int) -> bytes:
    """One scrape, read until the broker closes the connection, which it does only
    once the connection's slot is free (a client library stops at Content-Length)."""
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=PROMPT_S) as client:
        client.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        while chunk := client.recv(65536):
            reply += chunk
    return reply


def test_waiting_connections_cost_no_thread_and_the_oldest_make_room(
    server_factory: ServerFactory,
) -> None:
    """6,200 idle connections used to make 6,200 threads (and hold as many file
    descriptors). A connection whose request has not arrived costs no thread; beyond
    `MAX_WAITING` of them the oldest is dropped, and each is dropped once its request
    has not arrived within `REQUEST_TIMEOUT_S`."""
    server, port = prometheus_server(server_factory)
    assert _scrape_until_closed(port).startswith(b"HTTP/1.0 200")
    before = _threads(server.pid)
    extra = 20
    opened_at = time.monotonic()
    idle = []
    for _ in range(MAX_WAITING + extra):
        client = socket.create_connection(("127.0.0.1", port), timeout=PROMPT_S)
        client.sendall(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
        idle.append(client)
    try:
        oldest, held = idle[:extra], idle[extra:]
        # Dropped to make room, long before their deadline; the newer ones are kept.
        assert _closed_by_peer(oldest, within=REQUEST_TIMEOUT_S / 2) == oldest
        assert _closed_by_peer(held, within=0.1) == []
        assert _threads(server.pid) < before + 4  # not one per connection
        assert sample(scrape(port), "python_gc_frozen_objects")  # and a scrape is served
        assert len(_closed_by_peer(held, within=REQUEST_TIMEOUT_S + 2.0)) == len(held)
        assert time.monotonic() - opened_at >= REQUEST_TIMEOUT_S - 0.5  # not before
    finally:
        for client in idle:
            client.close()


class _SilentFlood:
    """`count` connections that never complete a request, kept open: each one the
    broker closes (a 503, or dropped at its deadline) is replaced at once, as an
    attacker's loop would. Half say nothing at all, half send part of a head."""

    def __init__(self, port: int, count: int) -> None:
        self._port = port
        self._socks = [self._open(i) for i in range(count)]
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_open, daemon=True)
        self._thread.start()

    def _open(self, i: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self._port), timeout=PROMPT_S)
        if i % 2:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and nothing more
        return sock

    def _keep_open(self) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select(self._socks, [], [], 0.05)
            for sock in readable:  # answered or closed by the broker: open another
                i = self._socks.index(sock)
                sock.close()
                self._socks[i] = self._open(i)
                self.reopened += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(PROMPT_S)
        for sock in self._socks:
            sock.close()


def test_silent_connections_do_not_lock_out_a_scraper(server_factory: ServerFactory) -> None:
    """Sixteen connections that sent nothing, reopened as the broker closed them,
    used to take every slot: each scrape was answered 503. Connections hold a slot
    only once their request has arrived, so a scraper among many silent ones is
    answered at once, every time, while they are dropped and reopened."""
    server, port = prometheus_server(server_factory)
    with grpc.insecure_channel(server.addr) as channel:
        admin_pb2_grpc.FilaAdminStub(channel).CreateQueue(
            admin_pb2.CreateQueueRequest(name="watched"), timeout=PROMPT_S
        )
    flood = _SilentFlood(port, SILENT_FLOOD)
    try:
        scrapes = 0
        until = time.monotonic() + REQUEST_TIMEOUT_S + 1.5  # past the silent ones' deadline
        while time.monotonic() < until or flood.reopened < SILENT_FLOOD:
            started = time.monotonic()
            status, body = _get(port, timeout=SCRAPE_S)
            assert status == 200, (scrapes, status, body)
            assert b'fila_queue_depth{queue="watched"} 0.0' in body
            assert time.monotonic() - started < SCRAPE_S
            scrapes += 1
            assert time.monotonic() < until + PROMPT_S, "the silent ones were never dropped"
            time.sleep(0.2)  # a scrape interval, not a wait for a condition
    finally:
        flood.close()
    assert scrapes >= 10


def test_openmetrics_with_gzip_as_prometheus_asks(server_factory: ServerFactory) -> None:
    server, port = prometheus_server(server_factory)
    with grpc.insecure_channel(server.addr) as channel:
        admin_pb2_grpc.FilaAdminStub(channel).CreateQueue(
            admin_pb2.CreateQueueRequest(name="om"), timeout=PROMPT_S
        )
    status, body = _get(port, {"Accept": OPENMETRICS_ACCEPT, "Accept-Encoding": "gzip"})
    assert status == 200
    families = {f.name: f for f in openmetrics_families(gzip.decompress(body).decode())}
    assert families["fila_storage_fsync_duration_seconds"].type == "histogram"
    assert families["target"].type == "info" and families["process_cpu_seconds"]
    (depth,) = families["fila_queue_depth"].samples[:1]
    assert depth.labels == {"queue": "om"} and depth.value == 0


def test_shutdown_does_not_wait_for_scrapers(server_factory: ServerFactory) -> None:
    """SIGTERM just after a scraper dropped hundreds of half-sent requests, with idle
    connections open. Each dropped request used to run a collection for nobody, on a
    thread of its own: 2,000 of them kept the broker up for 26 s."""
    server, port = prometheus_server(server_factory, BUFFERED)
    with grpc.insecure_channel(server.addr) as channel:
        admin = admin_pb2_grpc.FilaAdminStub(channel)
        for i in range(300):  # a collection is worth avoiding
            admin.CreateQueue(admin_pb2.CreateQueueRequest(name=f"q{i}"), timeout=PROMPT_S)
    idle, dropped = [], []
    try:
        for _ in range(MAX_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=PROMPT_S))
            idle[-1].sendall(b"GET /metrics HTTP/1.1\r\n")
        for _ in range(800):  # under a default limit of 1,024 descriptors
            dropped.append(socket.create_connection(("127.0.0.1", port), timeout=PROMPT_S))
            dropped[-1].sendall(b"GET /metrics HTTP/1.1\r\n")
        for client in dropped:
            client.close()  # half-sent, then gone
        started = time.monotonic()
        assert server.stop(timeout=15.0) == 0
        assert time.monotonic() - started < 3.0
    finally:
        for client in idle + dropped:
            client.close()
