"""How long and how much each benchmark runs: one profile for `--quick`, one for full.

Every workload is bounded twice: by time (measurement windows, drain deadlines) and
by count (backlogs, windows of deliveries), so a broker that slows down makes the run
fail or report a low number, never hang. The quick profile keeps the whole suite near
two minutes on two cores; the full one trades minutes for steadier medians.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    # Time-bounded throughput windows (enqueue, RSS under load, the durability matrix).
    warmup_s: float
    measure_s: float
    # echo_ceiling_50c: one window before the first case with rates and after each.
    ceiling_warmup_s: float
    ceiling_measure_s: float
    # Light-load end-to-end latency: one paced producer, one acking consumer.
    latency_rate: int
    latency_s: float
    # DRR vs FIFO: backlog drained per queue.
    drr_backlog: int
    # Fairness: SPEC 2 fixes the window at 5,000 deliveries; it slides by
    # `fairness_step` over a run of `fairness_run` deliveries.
    fairness_window: int
    fairness_step: int
    fairness_run: int
    # Key cardinality: backlog per level (at least one message per key) and the
    # number of deliveries timed out of it.
    cardinality_backlog: int
    cardinality_window: int
    # Consumer concurrency: backlog drained at each level, at least this many per
    # consumer, so that 100 streams have real work and not 20 messages each.
    concurrency_backlog: int
    concurrency_per_consumer: int
    # Lua overhead: alternating slices with and without the hook.
    lua_slices: int
    lua_slice_s: float
    # Compaction: paced probe before and during a burst of large writes.
    compaction_baseline_s: float
    burst_messages: int
    burst_payload: int
    # Batched drain: backlog drained by one batched stream.
    batch_drain_messages: int
    # Upper bound on any drain or preload; past it the benchmark fails.
    deadline_s: float
    # `--telemetry-scrape`: every broker serves Prometheus and is scraped this often
    # (None: telemetry off, the default), to measure what telemetry costs.
    telemetry_scrape_s: float | None = None


QUICK = Profile(
    name="quick",
    warmup_s=0.5,
    measure_s=2.0,
    ceiling_warmup_s=0.25,
    ceiling_measure_s=1.0,
    latency_rate=200,
    latency_s=3.0,
    drr_backlog=2_000,
    fairness_window=5_000,
    fairness_step=100,
    fairness_run=20_000,
    cardinality_backlog=10_000,
    cardinality_window=1_500,
    concurrency_backlog=2_000,
    concurrency_per_consumer=50,
    lua_slices=4,
    lua_slice_s=0.5,
    compaction_baseline_s=2.0,
    burst_messages=1_200,
    burst_payload=256 * 1024,
    batch_drain_messages=50_000,
    deadline_s=60.0,
)

FULL = Profile(
    name="full",
    warmup_s=1.0,
    measure_s=5.0,
    ceiling_warmup_s=0.5,
    ceiling_measure_s=2.0,
    latency_rate=200,
    latency_s=15.0,
    drr_backlog=10_000,
    fairness_window=5_000,
    fairness_step=100,
    fairness_run=30_000,
    cardinality_backlog=20_000,
    cardinality_window=5_000,
    concurrency_backlog=10_000,
    concurrency_per_consumer=100,
    lua_slices=10,
    lua_slice_s=1.0,
    compaction_baseline_s=5.0,
    burst_messages=2_400,
    burst_payload=256 * 1024,
    batch_drain_messages=200_000,
    deadline_s=180.0,
)
