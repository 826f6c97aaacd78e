#!/usr/bin/env python3
"""What telemetry costs the broker: throughput and broker CPU per message, on versus off.

    .venv/bin/python scripts/telemetry_overhead.py [--rounds 5] [--seconds 4]
        [--baseline-src DIR] [--traced] [--persist-mode sync|buffer]
    .venv/bin/python scripts/telemetry_overhead.py --micro

Each round starts a fresh broker per mode and runs the same three workloads on it:

- `enqueue`: unary Enqueue, 32 closed loops over 4 connections, 1 KiB payloads;
- `enqueue_batch`: EnqueueBatch of 100 messages, 4 closed loops;
- `stream_consume`: a StreamConsume drain (max_batch 100, prefetch 1,000, acks on the
  stream) of a preloaded backlog.

Modes: `off` (no exporter) and `on` (Prometheus endpoint scraped every second, OTLP
metrics every second to a receiver in this process: ten times the default export rate;
`--interval` changes both); `--modes` can add `prom` (Prometheus only) and `otlp`
(OTLP only, which also installs the tracing interceptor) to tell their costs apart.
`--traced` makes every request of `on` and `otlp` carry a sampled `traceparent`, so
each RPC also makes and exports a span. `--baseline-src DIR` adds `base`: the broker
from another source tree (say an export of main), to see what the core's own
bookkeeping costs. Modes run interleaved, their order rotating from round to round, so
drift in the machine's load falls on all of them alike; the report gives the median of
the rounds per mode and the difference to `off`.

Throughput depends on the client too (the load generator shares the machine), so the
broker's CPU time per message (from /proc, utime + stime over the measured window) is
reported beside it: it is the figure that shows a cost the client hides. Flat out, a
broker that the machine happens to slow down also forms smaller group commits and so
spends more per message; `--enqueue-rate` and `--batch-rate` hold the enqueue loads at
a fixed rate below capacity instead, so that both modes do the same work in the same
batches and only the CPU per message differs.

`--micro` measures the pieces in this process instead, which a busy machine disturbs
far less than an end-to-end run: what the core's bookkeeping adds per delivery (the
latency bucket), and what one collection (a scrape, or an OTLP export's read) costs
with 10, 100 and 1,000 queues.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from fila.testing.children import free_port, stop_child
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
PAYLOAD = b"x" * 1024
WORKLOADS = ("enqueue", "enqueue_batch", "stream_consume")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime


# -- an OTLP receiver that only counts ---------------------------------------------------------


class _Receiver(
    metrics_service_pb2_grpc.MetricsServiceServicer, trace_service_pb2_grpc.TraceServiceServicer
):
    def __init__(self) -> None:
        self.metric_exports = 0
        self.spans = 0

    def Export(self, request: Any, context: Any) -> Any:
        if isinstance(request, metrics_service_pb2.ExportMetricsServiceRequest):
            self.metric_exports += 1
            return metrics_service_pb2.ExportMetricsServiceResponse()
        self.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.contextmanager
def otlp_receiver() -> Iterator[tuple[str, _Receiver]]:
    receiver = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)  # type: ignore[no-untyped-call]
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", receiver
    finally:
        server.stop(grace=None)


# -- brokers --------------------------------------------------------------------------------------


@dataclass
class Broker:
    proc: subprocess.Popen[bytes]
    addr: str
    root: Path
    prometheus_port: int | None = None

    def stop(self) -> None:
        stop_child(self.proc, 30)
        shutil.rmtree(self.root, ignore_errors=True)


def start_broker(src: Path, config: str, workdir: Path) -> Broker:
    root = Path(tempfile.mkdtemp(prefix="overhead-", dir=workdir))
    (root / "fila.toml").write_text(config, encoding="utf-8")
    addr = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FILA_")}
    env |= {"PYTHONPATH": str(src), "FILA_DATA_DIR": str(root / "data"), "FILA_LISTEN_ADDR": addr}
    with (root / "fila-server.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fila.server.main", "--config", str(root / "fila.toml")],
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    broker = Broker(proc, addr, root)
    deadline = time.monotonic() + 30
    with grpc.insecure_channel(addr) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"broker exited: {(root / 'fila-server.log').read_text()}")
            try:
                reply = check(health_pb2.HealthCheckRequest(), timeout=0.5, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return broker
            except grpc.RpcError:
                time.sleep(0.05)  # not up yet; the deadline bounds the loop
    broker.stop()
    raise RuntimeError("broker did not become ready")


class Scraper:
    """Scrapes /metrics every `interval_s` on a thread, as Prometheus would."""

    def __init__(self, port: int, interval_s: float = 1.0) -> None:
        self.scrapes = 0
        self._url = f"http://127.0.0.1:{port}/metrics"
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            with urllib.request.urlopen(self._url, timeout=10) as reply:
                reply.read()
            self.scrapes += 1

    def __enter__(self) -> Scraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)


# -- workloads ----------------------------------------------------------------------------------


@dataclass
class Measured:
    messages: int
    seconds: float
    cpu_s: float

    @property
    def rate(self) -> float:
        return self.messages / self.seconds

    @property
    def cpu_us_per_message(self) -> float:
        return self.cpu_s / self.messages * 1e6


def channels(addr: str, count: int) -> list[grpc.aio.Channel]:
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)]
    return [grpc.aio.insecure_channel(addr, options=options) for _ in range(count)]


async def timed_loops(pid: int, loops: list[Any], warmup_s: float, seconds: float) -> Measured:
    """Runs closed loops (coroutine functions taking a `counting` flag holder) for
    warmup + `seconds`; counts messages answered within the measured window."""
    state = {"counting": False, "stop": False, "messages": 0}

    async with asyncio.TaskGroup() as group:
        for loop in loops:
            group.create_task(loop(state))
        await asyncio.sleep(warmup_s)
        cpu0, t0 = cpu_seconds(pid), time.perf_counter()
        state["counting"] = True
        await asyncio.sleep(seconds)
        state["counting"] = False
        cpu1, t1 = cpu_seconds(pid), time.perf_counter()
        state["stop"] = True
    return Measured(int(state["messages"]), t1 - t0, cpu1 - cpu0)


async def pace(next_at: float, interval: float) -> float:
    """Sleeps until `next_at` (a closed loop when `interval` is 0); returns the next one."""
    if interval:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
    return next_at + interval


async def enqueue_unary(broker: Broker, seconds: float, metadata: Any, rate: float) -> Measured:
    chans = channels(broker.addr, 4)
    stubs = [service_pb2_grpc.FilaServiceStub(c) for c in chans]
    request = service_pb2.EnqueueRequest(queue="unary", payload=PAYLOAD)
    loops = 32
    interval = loops / rate if rate else 0.0

    def loop(stub: Any) -> Any:
        async def run(state: dict[str, Any]) -> None:
            next_at = time.perf_counter()
            while not state["stop"]:
                next_at = await pace(next_at, interval)
                await stub.Enqueue(request, metadata=metadata, timeout=30)
                if state["counting"]:
                    state["messages"] += 1

        return run

    try:
        return await timed_loops(
            broker.proc.pid, [loop(stubs[i % 4]) for i in range(loops)], 1.0, seconds
        )
    finally:
        for c in chans:
            await c.close(None)


async def enqueue_batch(broker: Broker, seconds: float, metadata: Any, rate: float) -> Measured:
    chans = channels(broker.addr, 4)
    stubs = [service_pb2_grpc.FilaServiceStub(c) for c in chans]
    batch = service_pb2.EnqueueBatchRequest(
        messages=[service_pb2.EnqueueRequest(queue="batch", payload=PAYLOAD)] * 100
    )
    interval = len(stubs) * 100 / rate if rate else 0.0

    def loop(stub: Any) -> Any:
        async def run(state: dict[str, Any]) -> None:
            next_at = time.perf_counter()
            while not state["stop"]:
                next_at = await pace(next_at, interval)
                await stub.EnqueueBatch(batch, metadata=metadata, timeout=30)
                if state["counting"]:
                    state["messages"] += 100

        return run

    try:
        return await timed_loops(broker.proc.pid, [loop(s) for s in stubs], 1.0, seconds)
    finally:
        for c in chans:
            await c.close(None)


async def stream_consume(broker: Broker, backlog: int, metadata: Any) -> Measured:
    (chan,) = channels(broker.addr, 1)
    stub = service_pb2_grpc.FilaServiceStub(chan)
    batch = service_pb2.EnqueueBatchRequest(
        messages=[service_pb2.EnqueueRequest(queue="drain", payload=PAYLOAD)] * 1000
    )
    for _ in range(backlog // 1000):
        await stub.EnqueueBatch(batch, timeout=60)
    acks: asyncio.Queue[service_pb2.StreamConsumeRequest | None] = asyncio.Queue()
    acks.put_nowait(service_pb2.StreamConsumeRequest(queue="drain", max_batch=100, prefetch=1000))

    async def requests() -> Any:
        while (request := await acks.get()) is not None:
            yield request

    call = stub.StreamConsume(requests(), metadata=metadata)
    received = 0
    cpu0, t0 = cpu_seconds(broker.proc.pid), time.perf_counter()
    async for frame in call:
        ids = [m.id for m in frame.messages]
        if ids:
            received += len(ids)
            acks.put_nowait(service_pb2.StreamConsumeRequest(ack_ids=ids))
        if received >= backlog:
            break
    cpu1, t1 = cpu_seconds(broker.proc.pid), time.perf_counter()
    acks.put_nowait(None)
    call.cancel()
    await chan.close(None)
    return Measured(received, t1 - t0, cpu1 - cpu0)


async def run_workloads(
    broker: Broker, args: argparse.Namespace, metadata: Any, workloads: list[str]
) -> dict[str, Measured]:
    seconds, backlog = args.seconds, args.backlog
    async with grpc.aio.insecure_channel(broker.addr) as chan:
        admin = admin_pb2_grpc.FilaAdminStub(chan)
        for name in ("unary", "batch", "drain"):
            await admin.CreateQueue(admin_pb2.CreateQueueRequest(name=name), timeout=30)
    measured = {}
    if "enqueue" in workloads:
        measured["enqueue"] = await enqueue_unary(broker, seconds, metadata, args.enqueue_rate)
    if "enqueue_batch" in workloads:
        measured["enqueue_batch"] = await enqueue_batch(broker, seconds, metadata, args.batch_rate)
    if "stream_consume" in workloads:
        measured["stream_consume"] = await stream_consume(broker, backlog, metadata)
    return measured


# -- the experiment -------------------------------------------------------------------------------


@dataclass
class Results:
    rates: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    cpu: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, mode: str, measured: dict[str, Measured]) -> None:
        for workload, m in measured.items():
            self.rates.setdefault((mode, workload), []).append(m.rate)
            self.cpu.setdefault((mode, workload), []).append(m.cpu_us_per_message)


def config_for(
    mode: str, persist_mode: str, otlp: str, prometheus_port: int, interval_s: float
) -> str:
    text = f'[storage]\npersist_mode = "{persist_mode}"\n[telemetry]\n'
    if mode in ("on", "prom"):
        text += f'prometheus_listen = "127.0.0.1:{prometheus_port}"\n'
    if mode in ("on", "otlp"):
        interval_ms = int(interval_s * 1000)
        text += f'otlp_endpoint = "{otlp}"\nmetrics_interval_ms = {interval_ms}\n'
    return text


def micro() -> None:
    """Per-delivery and per-collection costs, timed in this process (see the docstring)."""
    import tracemalloc

    from prometheus_client import CollectorRegistry

    from fila.core.records import MessageRef
    from fila.telemetry.histogram import LOOP_LAG_BOUNDS_S, FixedHistogram
    from fila.telemetry.prometheus import PrometheusExposition, negotiate
    from fila.v1 import service_pb2 as s

    sys.path.insert(0, str(REPO / "tests"))
    from support.core import make_core  # type: ignore[import-not-found]

    async def build(queues: int) -> Any:
        core = make_core(queues=[f"q{i}" for i in range(queues)])
        await core.settle()
        core.broker.enqueue([s.EnqueueRequest(queue=f"q{i}", payload=b"x") for i in range(queues)])
        await core.settle()
        return core

    queue_core = asyncio.run(build(1))
    queue = next(iter(queue_core.broker.queues.values()))
    refs = [MessageRef(b"m" + queue_core.broker.ids.next()[0], "k", 1, (), 0) for _ in range(1000)]
    now = queue_core.clock.now_ms()
    rounds = []
    for _ in range(20):
        started = time.perf_counter()
        for ref in refs:
            queue.count_delivery(ref, now)
        with_latency = time.perf_counter() - started
        for ref in refs:
            ref.attempt_count = 1  # retries skip the latency bucket
        started = time.perf_counter()
        for ref in refs:
            queue.count_delivery(ref, now)
        without = time.perf_counter() - started
        for ref in refs:
            ref.attempt_count = 0
        rounds.append((with_latency - without) / len(refs) * 1e9)
    print(f"latency bucket per first delivery: {statistics.median(rounds):.0f} ns (median of 20)")

    for queues in (10, 100, 1000, 5000):
        core = asyncio.run(build(queues))
        exposition = PrometheusExposition(
            core.broker, core.committer, CollectorRegistry(), FixedHistogram(LOOP_LAG_BOUNDS_S)
        )
        fmt = negotiate(None)
        exposition.render(fmt)  # warm up
        times = []
        for _ in range(5):
            started = time.process_time()
            body = b"".join(exposition.render(fmt))
            times.append(time.process_time() - started)
        tracemalloc.start()  # apart: tracing every allocation slows the render several-fold
        exposition.render(fmt)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(
            f"one Prometheus collection, {queues:>4} queues (+DLQs): "
            f"{statistics.median(times) * 1000:.1f} ms CPU, {peak / 2**20:.1f} MiB at peak, "
            f"{len(body) / 1024:.0f} KiB"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0, help="measured window per load")
    parser.add_argument("--backlog", type=int, default=30_000, help="messages to drain")
    parser.add_argument(
        "--enqueue-rate",
        type=float,
        default=0,
        help="unary enqueues/s to hold (0: as fast as the broker answers)",
    )
    parser.add_argument(
        "--batch-rate", type=float, default=0, help="batched messages/s to hold (0: flat out)"
    )
    parser.add_argument("--baseline-src", type=Path, help="source tree of a baseline broker")
    parser.add_argument("--traced", action="store_true", help="send traceparent when on")
    parser.add_argument("--persist-mode", choices=("sync", "buffer"), default="sync")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between scrapes and between OTLP exports (default 1: ten times the "
        "default export rate; 10 is the default metrics_interval_ms)",
    )
    parser.add_argument("--micro", action="store_true", help="time the pieces in-process")
    parser.add_argument(
        "--modes", default="off,on", help="comma-separated: off, on, prom, otlp (default off,on)"
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {WORKLOADS}"
    )
    args = parser.parse_args()
    if args.micro:
        micro()
        return 0

    modes = args.modes.split(",") + (["base"] if args.baseline_src else [])
    workloads = args.workloads.split(",")
    results = Results()
    workdir = Path(tempfile.mkdtemp(prefix="fila-telemetry-overhead-"))
    traced = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    with otlp_receiver() as (endpoint, receiver):
        for round_no in range(args.rounds):
            shift = round_no % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                src = args.baseline_src if mode == "base" else REPO
                prometheus_port = free_port()
                config = config_for(
                    mode, args.persist_mode, endpoint, prometheus_port, args.interval
                )
                broker = start_broker(src, config, workdir)
                metadata = traced if (mode in ("on", "otlp") and args.traced) else None
                try:
                    scraping = (
                        Scraper(prometheus_port, args.interval)
                        if mode in ("on", "prom")
                        else contextlib.nullcontext()
                    )
                    with scraping:
                        measured = asyncio.run(run_workloads(broker, args, metadata, workloads))
                finally:
                    broker.stop()
                results.add(mode, measured)
                summary = "  ".join(
                    f"{w}={m.rate:,.0f}/s {m.cpu_us_per_message:.0f}us" for w, m in measured.items()
                )
                print(f"round {round_no + 1} {mode:>4}: {summary}", flush=True)
        print(f"(receiver got {receiver.metric_exports} metric exports, {receiver.spans} spans)")
    shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(
        f"median of {args.rounds} rounds, persist_mode={args.persist_mode}, "
        f"traced={args.traced}, collection every {args.interval:g} s"
    )
    print(f"{'workload':<16}{'mode':<6}{'msgs/s':>12}{'vs off':>9}{'cpu us/msg':>12}{'vs off':>9}")
    for workload in workloads:
        base_rate = statistics.median(results.rates[("off", workload)])
        base_cpu = statistics.median(results.cpu[("off", workload)])
        for mode in modes:
            rate = statistics.median(results.rates[(mode, workload)])
            cpu = statistics.median(results.cpu[(mode, workload)])
            print(
                f"{workload:<16}{mode:<6}{rate:>12,.0f}{(rate / base_rate - 1) * 100:>+8.1f}%"
                f"{cpu:>12.1f}{(cpu / base_cpu - 1) * 100:>+8.1f}%"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
