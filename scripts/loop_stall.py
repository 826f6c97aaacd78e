#!/usr/bin/env python3
"""How long the broker's event loop is held by a Redrive of many fairness keys and by
PeekMessages over a large delayed set, at the sizes of issue 29.

    .venv/bin/python scripts/loop_stall.py [--keys 80000] [--delayed 1000000]
        [--pages 50] [--persist-mode sync|buffer]

Starts a fresh `fila-server` (Prometheus on a free port) and runs two phases, each
while a probe producer enqueues to an unrelated queue every 5 ms (one call in flight):

- redrive: a DLQ holding `--keys` messages, each with a fairness key of its own, is
  redriven with count 0; reported: the Redrive call's time and the probe's latencies;
- peek: the redriven queue (a fairness key per message, each ready) is paged with
  `limit=1`; then a queue holding `--delayed` messages delayed for an hour (0: this
  part is skipped) with `limit=1` (`--pages` pages, each after the last) and
  `limit=100`; reported: each page's time and the probe's latencies;
- purge and delete: PurgeQueue of the delayed queue, then DeleteQueue of the redriven
  one; reported: each call's time and the probe's latencies.

Where the broker exports `fila_loop_lag_seconds`, each phase also reports the loop
lag samples taken during it (their count, the bucket of the 99th percentile, and the
largest bucket reached). Setup uses the batch paths and is not measured. Figures go
to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the loads are shared with tests/test_loop_lag.py

from support.stall import (  # noqa: E402
    Probe,
    Stubs,
    fill_delayed,
    fill_dlq,
    lag_between,
    percentile,
    quantile_bound,
    scrape_lag,
)

from fila.v1 import admin_pb2  # noqa: E402

try:
    from fila.testing.children import free_port
    from fila.testing.server import ServerProcess
except ImportError:  # a tree from before fila/testing (the "before" of a comparison)
    from fila.server.process import ServerProcess, free_port  # type: ignore[no-redef]


def report_probe(probe: Probe) -> str:
    lat = probe.latencies
    return (
        f"probe Enqueue: {len(lat)} calls, p50 {percentile(lat, 0.5) * 1e3:.1f} ms, "
        f"p99 {percentile(lat, 0.99) * 1e3:.1f} ms, max {max(lat, default=0) * 1e3:.1f} ms"
        + (f", {len(probe.errors)} errors" if probe.errors else "")
    )


def report_lag(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> str:
    if not before or not after:
        return "loop lag: not exported by this broker"
    buckets = lag_between(before, after)
    worst = max((le for le, n in buckets if n), default=0.0)
    return (
        f"loop lag: {sum(n for _, n in buckets)} samples, p99 <= "
        f"{quantile_bound(buckets, 0.99) * 1e3:g} ms, max <= {worst * 1e3:g} ms"
    )


def peek_pages(stubs: Stubs, prometheus_port: int, queue: str, limit: int, pages: int) -> None:
    """Pages through `queue` (`pages` pages of `limit`, each after the last) while the
    probe enqueues; prints each page's time, the probe's latencies and the loop lag."""
    lag_before = scrape_lag(prometheus_port)
    took: list[float] = []
    after = ""
    with Probe(stubs, "probe") as probe:
        time.sleep(0.2)
        for _ in range(pages):
            started = time.perf_counter()
            reply = stubs.admin.PeekMessages(
                admin_pb2.PeekMessagesRequest(queue=queue, limit=limit, after_id=after),
                timeout=600,
            )
            took.append(time.perf_counter() - started)
            assert len(reply.messages) == limit
            after = reply.next_after_id
        time.sleep(0.2)
    print(
        f"  PeekMessages limit={limit}: {len(took)} pages, median "
        f"{statistics.median(took) * 1e3:.1f} ms, max {max(took) * 1e3:.1f} ms"
    )
    print(f"  {report_probe(probe)}")
    print(f"  {report_lag(lag_before, scrape_lag(prometheus_port))}", flush=True)


def timed_admin(stubs: Stubs, prometheus_port: int, rpc: str, queue: str) -> None:
    """One PurgeQueue or DeleteQueue of `queue` while the probe enqueues: its time, the
    probe's latencies and the loop lag."""
    request = getattr(admin_pb2, f"{rpc}Request")(queue=queue)
    lag_before = scrape_lag(prometheus_port)
    with Probe(stubs, "probe") as probe:
        time.sleep(0.2)
        started = time.perf_counter()
        getattr(stubs.admin, rpc)(request, timeout=600)
        took = time.perf_counter() - started
        time.sleep(0.2)
    print(f"  {rpc}: {took:.2f} s")
    print(f"  {report_probe(probe)}")
    print(f"  {report_lag(lag_before, scrape_lag(prometheus_port))}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=80_000)
    parser.add_argument("--delayed", type=int, default=1_000_000)
    parser.add_argument("--pages", type=int, default=50)
    parser.add_argument("--persist-mode", default="sync", choices=("sync", "buffer"))
    args = parser.parse_args()

    prometheus_port = free_port()
    config = f'[telemetry]\nprometheus_listen = "127.0.0.1:{prometheus_port}"\n'
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            Path(tmp) / "data", config_toml=config, persist_mode=args.persist_mode
        ).start(60)
        try:
            with grpc.insecure_channel(
                server.addr, options=[("grpc.max_receive_message_length", 64 << 20)]
            ) as channel:
                stubs = Stubs(channel)
                stubs.admin.CreateQueue(admin_pb2.CreateQueueRequest(name="probe"))

                started = time.monotonic()
                fill_dlq(stubs, "keys", args.keys)
                print(
                    f"redrive: {args.keys} dead letters, one key each "
                    f"(setup {time.monotonic() - started:.0f} s)",
                    flush=True,
                )
                lag_before = scrape_lag(prometheus_port)
                with Probe(stubs, "probe") as probe:
                    time.sleep(0.2)
                    started = time.perf_counter()
                    moved = stubs.admin.Redrive(
                        admin_pb2.RedriveRequest(dlq_queue="keys.dlq"), timeout=600
                    ).redriven
                    took = time.perf_counter() - started
                    time.sleep(0.2)
                print(f"  Redrive(count=0): {moved} moved in {took:.2f} s")
                print(f"  {report_probe(probe)}")
                print(f"  {report_lag(lag_before, scrape_lag(prometheus_port))}", flush=True)
                print(f"peek: the {args.keys} keys redriven, each with a ready message")
                peek_pages(stubs, prometheus_port, "keys", 1, args.pages // 5)

                if not args.delayed:
                    return

                started = time.monotonic()
                fill_delayed(stubs, "later", args.delayed)
                print(
                    f"peek: {args.delayed} delayed messages "
                    f"(setup {time.monotonic() - started:.0f} s)",
                    flush=True,
                )
                for limit in (1, 100):
                    peek_pages(stubs, prometheus_port, "later", limit, args.pages)
                print(f"purge and delete: the {args.keys} ready and {args.delayed} delayed")
                timed_admin(stubs, prometheus_port, "PurgeQueue", "later")
                timed_admin(stubs, prometheus_port, "DeleteQueue", "keys")
        finally:
            server.stop(120)


if __name__ == "__main__":
    main()
