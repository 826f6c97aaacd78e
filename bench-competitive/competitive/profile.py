"""How much each run does: the quick profile (CI and smoke runs) and the full one.

Counts scale with the number of connections, as in the seed reports, so that cells
take comparable wall time; throughput is a rate, so rows stay comparable. Every phase
is bounded twice: by a time budget (a phase that reaches it stops taking new jobs,
finishes what is in flight, and its row says so) and by a hard deadline past which
the cell fails instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    reps: int
    jobs_by_connections: dict[int, int]
    latency_rounds: int
    latency_warmup: int
    batched_jobs: int
    payload_sizes: tuple[int, ...]
    payload_jobs: int
    lifecycle_jobs: int
    multi_producer_jobs: int
    phase_budget_s: float
    deadline_s: float
    # A drain with no ack for this long, from a broker that reports itself empty, ends
    # there (jobs were lost) and the conservation check says which.
    idle_s: float = 5.0
    job_bytes: int = 256
    extras_payload: int = 1024  # lifecycle and multi-producer, as in the seed (1 KB)
    producers: int = 3  # the multi-producer row
    # The batched rows' client batch size is the adapters' (100 in flight everywhere).
    notes: tuple[str, ...] = field(default=())

    @property
    def connections(self) -> tuple[int, ...]:
        return tuple(sorted(self.jobs_by_connections))


QUICK = Profile(
    name="quick",
    reps=1,
    jobs_by_connections={1: 500, 50: 2_500},
    latency_rounds=300,
    latency_warmup=20,
    batched_jobs=5_000,
    payload_sizes=(),
    payload_jobs=0,
    lifecycle_jobs=0,
    multi_producer_jobs=0,
    phase_budget_s=15.0,
    deadline_s=60.0,
)

FULL = Profile(
    name="full",
    reps=3,
    jobs_by_connections={1: 2_000, 8: 5_000, 50: 10_000},
    latency_rounds=1_000,
    latency_warmup=50,
    batched_jobs=20_000,
    payload_sizes=(64, 1024, 65_536),
    payload_jobs=2_000,
    lifecycle_jobs=2_000,
    multi_producer_jobs=3_000,
    phase_budget_s=30.0,
    deadline_s=120.0,
)

PROFILES = {p.name: p for p in (QUICK, FULL)}
