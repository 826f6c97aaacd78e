"""Loads that once held the broker's event loop, and what to watch while they run.

Shared by tests/test_loop_lag.py (small sizes, in the default run) and
scripts/loop_stall.py (the sizes of issue 29, run by hand):

- `fill_dlq`: a dead-letter queue whose messages each have a fairness key of their own
  (the Redrive that removed one DRR key per message);
- `fill_delayed`: a queue of messages delayed for an hour (the PeekMessages that
  sorted every one of them on each page);
- `Probe`: an unrelated producer that enqueues once every few milliseconds and keeps
  each answer's latency, which is how long a client waits behind the loop;
- `scrape_lag`: the broker's own loop-lag histogram (`fila_loop_lag_seconds`) from
  its Prometheus endpoint, as (upper bound, cumulative count) pairs.

Everything goes through the raw `fila.v1` stubs and the batch paths, so setup is
quick even at a million messages.
"""

from __future__ import annotations

import queue
import re
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc

from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

BATCH = 10_000
SETUP_TIMEOUT_S = 120.0
KEY_PER_MESSAGE = "function on_enqueue(m) return { fairness_key = m.headers.k } end"
TO_DLQ = 'function on_failure(m) return { action = "dlq" } end'
HOUR_MS = 3_600_000


class Stubs:
    """The two services over one channel."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.svc = service_pb2_grpc.FilaServiceStub(channel)
        self.admin = admin_pb2_grpc.FilaAdminStub(channel)

    def depth(self, queue_name: str) -> tuple[int, int]:
        stats = self.admin.GetStats(admin_pb2.GetStatsRequest(queue=queue_name), timeout=30)
        return int(stats.depth), int(stats.in_flight)

    def enqueue_batch(self, requests: list[service_pb2.EnqueueRequest]) -> None:
        for start in range(0, len(requests), BATCH):
            reply = self.svc.EnqueueBatch(
                service_pb2.EnqueueBatchRequest(messages=requests[start : start + BATCH]),
                timeout=SETUP_TIMEOUT_S,
            )
            failed = [r.error for r in reply.results if r.HasField("error")]
            assert not failed, failed[:3]


def fill_dlq(stubs: Stubs, queue_name: str, keys: int) -> None:
    """Creates `queue_name` and dead-letters `keys` messages into its DLQ, each with a
    fairness key of its own (`k0`, `k1`, ...): consumed over one StreamConsume, nacked
    with NackBatch while the stream stays open (a stream that ends returns its leases)."""
    config = admin_pb2.QueueConfig(on_enqueue_script=KEY_PER_MESSAGE, on_failure_script=TO_DLQ)
    stubs.admin.CreateQueue(admin_pb2.CreateQueueRequest(name=queue_name, config=config))
    stubs.enqueue_batch(
        [
            service_pb2.EnqueueRequest(queue=queue_name, headers={"k": f"k{i}"}, payload=b"x")
            for i in range(keys)
        ]
    )
    requests: queue.Queue[service_pb2.StreamConsumeRequest | None] = queue.Queue()
    requests.put(service_pb2.StreamConsumeRequest(queue=queue_name, max_batch=1000, prefetch=BATCH))

    def send() -> Iterator[service_pb2.StreamConsumeRequest]:
        while (request := requests.get()) is not None:
            yield request

    stream = stubs.svc.StreamConsume(send())
    nacked = 0
    try:
        for frame in stream:
            nacks = [
                service_pb2.NackRequest(queue=queue_name, message_id=m.id, error="x")
                for m in frame.messages
            ]
            if not nacks:
                continue
            reply = stubs.svc.NackBatch(
                service_pb2.NackBatchRequest(nacks=nacks), timeout=SETUP_TIMEOUT_S
            )
            assert all(r.code == 0 for r in reply.results)
            nacked += len(nacks)
            if nacked >= keys:
                break
    finally:
        requests.put(None)
        stream.cancel()
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while stubs.depth(queue_name + ".dlq") != (keys, 0):
        assert time.monotonic() < deadline, "the DLQ did not fill"
        time.sleep(0.05)


def fill_delayed(stubs: Stubs, queue_name: str, count: int) -> None:
    """Creates `queue_name` holding `count` messages delayed for an hour."""
    stubs.admin.CreateQueue(admin_pb2.CreateQueueRequest(name=queue_name))
    for start in range(0, count, BATCH):
        stubs.enqueue_batch(
            [
                service_pb2.EnqueueRequest(queue=queue_name, payload=b"x", delay_ms=HOUR_MS)
                for _ in range(min(BATCH, count - start))
            ]
        )


class Probe:
    """Enqueues to `queue_name` every `interval_s` on a thread of its own, one call in
    flight, and keeps each call's latency (seconds) while running (a context manager)."""

    def __init__(self, stubs: Stubs, queue_name: str, interval_s: float = 0.005) -> None:
        self._stubs = stubs
        self._queue = queue_name
        self._interval = interval_s
        self.latencies: list[float] = []
        self.errors: list[grpc.RpcError] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        request = service_pb2.EnqueueRequest(queue=self._queue, payload=b"probe")
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                self._stubs.svc.Enqueue(request, timeout=60)
            except grpc.RpcError as exc:
                self.errors.append(exc)
            self.latencies.append(time.perf_counter() - started)
            self._stop.wait(self._interval)


_BUCKET = re.compile(r'^fila_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', re.M)


def scrape_lag(prometheus_port: int) -> list[tuple[float, float]]:
    """`fila_loop_lag_seconds` buckets as (le, cumulative count); [] if not exported."""
    url = f"http://127.0.0.1:{prometheus_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return [(float(le), float(count)) for le, count in _BUCKET.findall(text)]


def lag_between(
    before: list[tuple[float, float]], after: list[tuple[float, float]]
) -> list[tuple[float, int]]:
    """The samples taken between two scrapes, per bucket (le, count in that bucket)."""
    counts: list[tuple[float, int]] = []
    below_before = below_after = 0.0
    for (le, cum_before), (_, cum_after) in zip(before, after, strict=True):
        counts.append((le, round((cum_after - below_after) - (cum_before - below_before))))
        below_before, below_after = cum_before, cum_after
    return counts


def quantile_bound(buckets: list[tuple[float, int]], q: float) -> float:
    """The upper bound of the bucket holding quantile `q` of the samples."""
    total = sum(n for _, n in buckets)
    seen = 0
    for le, n in buckets:
        seen += n
        if seen >= q * total:
            return le
    return float("inf")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0
