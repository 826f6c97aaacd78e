"""Published figures of brokers that cannot run here, quoted, never measured.

Kafka, Faktory, sepp and bunqueue have no package in any registry these machines
reach (Debian, PyPI, npm), so the harness cannot start them. Their own reports'
figures are quoted below with where they come from and what they ran on, so a reader
can place them, and they appear only in a table of their own: they are other
hardware, other clients (Rust, Go, Bun) and Docker, and are never mixed into the
measured rows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Quoted:
    broker: str
    figure: str  # what was measured, in the source's words
    value: str  # as published
    source: str  # which report, on what


_SEPP = (
    "sepp's benchmark report (Docker on a Ryzen 5 7600X, NVMe; Rust clients; "
    "50 producers / 50 workers, 256-byte jobs, one in flight each)"
)
_FILA_RS = (
    "upstream Fila's (Rust) docs/benchmarks.md, commit 4535e4a (Docker; native Rust "
    "clients; single run)"
)
_BUNQUEUE = (
    "bunqueue's SDK report, 2.8.43 (Apple M1 Max, native, no Docker; 8 producers, "
    "addBulk of 50, ~256-byte jobs; median of 5)"
)

PUBLISHED: tuple[Quoted, ...] = (
    Quoted("sepp", "durable enqueue / drain, jobs/s", "15,325 / 6,980", _SEPP),
    Quoted("sepp", "durable latency p50 / p99 / p999, ms", "4.820 / 9.784 / 12.755", _SEPP),
    Quoted("sepp", "buffered enqueue / drain, jobs/s", "52,325 / 25,124", _SEPP),
    Quoted("sepp", "buffered latency p50 / p99 / p999, ms", "1.077 / 1.305 / 1.728", _SEPP),
    Quoted("Faktory 1.9.4", "durable", "none available (RDB snapshots only)", _SEPP),
    Quoted("Faktory 1.9.4", "buffered enqueue / drain, jobs/s", "77,643 / 23,315", _SEPP),
    Quoted(
        "Faktory 1.9.4", "buffered latency p50 / p99 / p999, ms", "0.855 / 1.052 / 1.178", _SEPP
    ),
    Quoted(
        "Kafka 3.9 (KRaft, 1 partition, linger.ms=5)",
        "throughput 64 B / 1 KB / 64 KB, msg/s",
        "1,473,379 / 143,278 / 2,335",
        _FILA_RS,
    ),
    Quoted("Kafka 3.9", "latency p50 / p95 / p99, ms (1 KB)", "101.62 / 105.07 / 105.30", _FILA_RS),
    Quoted("Kafka 3.9", "lifecycle (enqueue, consume, ack), msg/s", "356", _FILA_RS),
    Quoted("Kafka 3.9", "3 producers, msg/s (1 KB)", "186,708", _FILA_RS),
    Quoted("Kafka 3.9", "resources: CPU / memory", "2.1% / 1,276 MB", _FILA_RS),
    Quoted(
        "Fila (Rust, upstream)",
        "throughput 64 B / 1 KB / 64 KB, msg/s",
        "2,758 / 2,326 / 296",
        _FILA_RS,
    ),
    Quoted(
        "Fila (Rust, upstream)", "lifecycle, msg/s / 3 producers, msg/s", "2,393 / 6,343", _FILA_RS
    ),
    Quoted("bunqueue (Python SDK)", "producer, jobs/s", "60,701", _BUNQUEUE),
    Quoted("bunqueue (Rust SDK)", "producer, jobs/s", "63,735", _BUNQUEUE),
    Quoted(
        "bunqueue (Python SDK)",
        "worker, 16 slots, 1 ms handler, jobs/s",
        "268",
        "bunqueue's SDK report (as above; limited by the SDK's 50 ms refill sleep)",
    ),
)
