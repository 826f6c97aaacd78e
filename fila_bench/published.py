"""Figures the Rust Fila publishes for its own self-benchmark, quoted for comparison.

Source: Fila's `docs/benchmarks.md`, "a single reference run" at commit 4535e4a of
the Rust implementation, in Docker on their hardware (not stated beyond that). They
are theirs, not ours: different language, machine and harness, so they are a point
of reference beside our figures, never a baseline for the gate. Only figures whose
workload matches one of ours closely enough to sit beside it are listed, under our
result names.
"""

from __future__ import annotations

SOURCE = "Rust Fila, published reference run (commit 4535e4a, their hardware)"

PUBLISHED: dict[str, float] = {
    # single producer, 1 KB, 3 s window after 1 s warmup
    "enqueue_1kb_sync_1p": 5_348.0,
    # light load, one producer, produce -> consume, 100 samples
    "latency_p50_ms": 0.22,
    "latency_p95_ms": 0.33,
    "latency_p99_ms": 0.50,
    # FIFO baseline against DRR
    "consume_fifo_1key": 2_140.0,
    "consume_drr_100keys": 2_114.0,
    "drr_overhead_pct": 1.2,
    # on_enqueue hook, per message
    "enqueue_lua_off": 1_734.0,
    "enqueue_lua_on": 1_717.0,
    "lua_overhead_us": 5.9,
    # fairness-key cardinality
    "consume_keys_10": 4_943.0,
    "consume_keys_1000": 4_124.0,
    "consume_keys_10000": 2_053.0,
    # consumer concurrency
    "consume_consumers_1": 1_012.0,
    "consume_consumers_10": 3_628.0,
    "consume_consumers_100": 3_544.0,
    # memory (MB as published; RSS under load with 10K messages)
    "rss_idle_mib": 239.0,
    "rss_load_mib": 232.0,
    # p99 idle and during compaction
    "compaction_p99_baseline_ms": 0.32,
    "compaction_p99_burst_ms": 0.29,
}
