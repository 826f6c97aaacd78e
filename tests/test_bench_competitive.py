"""The competitive harness's own parts: payload tags, the conservation check, statistics,
the summary and Markdown writers, charts, process handling, and one real Fila cell.

Only Fila is started here (the other brokers are proven by `bench-competitive/ci-smoke.sh`
and the runs themselves); everything else is pure and fast. The conservation check is
shown to catch a broker that loses jobs and one that duplicates them, against a real
`fila-server` whose client is sabotaged on purpose.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench-competitive"))

from competitive import conservation, netstat, payload, procs
from competitive.adapters import NAMES, load
from competitive.adapters.base import Delivery, Session
from competitive.adapters.fila import Fila, batch_api_missing
from competitive.cells import Batched, Matrix
from competitive.cli import parse
from competitive.conservation import Ledger
from competitive.model import NOT_AVAILABLE, OK, CellKey, Measurement, Row
from competitive.profile import FULL, QUICK, Profile
from competitive.published import PUBLISHED
from competitive.report import markdown
from competitive.report.summary import TOP_LEVEL, Summary, read, write
from competitive.stats import aggregate, latency_percentiles_ms, summarize

ROW_FIELDS = [
    "broker",
    "mode",
    "batching",
    "workload",
    "connections",
    "payload_bytes",
    "value",
    "unit",
    "min",
    "max",
    "reps",
    "conservation",
    "note",
]

# --- payload tags -------------------------------------------------------------------


def test_payload_carries_its_index_at_every_size() -> None:
    for size in (16, 64, 256, 1024, 65_536):
        body = payload.make(123_456, size)
        assert len(body) == size
        assert payload.index_of(body) == 123_456


def test_payload_without_a_tag_is_rejected() -> None:
    with pytest.raises(payload.PayloadError):
        payload.index_of(b"x" * 64)
    with pytest.raises(payload.PayloadError):
        payload.index_of(b"12")
    with pytest.raises(ValueError, match="below"):
        payload.make(1, 8)


# --- conservation -------------------------------------------------------------------


def _ledger(confirmed: list[int], delivered: list[int], size: int = 64) -> Ledger:
    ledger = Ledger(size)
    for i in confirmed:
        ledger.confirm(i)
    for i in delivered:
        ledger.deliver(payload.make(i, size))
    return ledger


def test_conservation_ok_when_every_job_comes_back_once() -> None:
    ledger = _ledger([0, 1, 2, 3], [3, 1, 0, 2])
    assert conservation.check(ledger, remaining=0, expected=4) == OK


def test_conservation_reports_lost_jobs() -> None:
    status = conservation.check(_ledger([0, 1, 2, 3], [0, 1]), remaining=0)
    assert status.startswith("failed:")
    assert "2 lost (e.g. 2, 3)" in status


def test_conservation_reports_duplicates_and_strangers() -> None:
    status = conservation.check(_ledger([0, 1], [0, 1, 1, 7]), remaining=0)
    assert "1 delivered more than once (e.g. 1)" in status
    assert "1 delivered but never confirmed (e.g. 7)" in status


def test_conservation_reports_what_the_broker_still_holds_and_short_counts() -> None:
    status = conservation.check(_ledger([0, 1], [0, 1]), remaining=3, expected=5)
    assert "broker still holds 3" in status
    assert "2 of 5 enqueues confirmed" in status


def test_conservation_reports_malformed_payloads() -> None:
    ledger = _ledger([0], [])
    ledger.deliver(payload.make(0, 32))  # sent 64 bytes, came back 32
    ledger.deliver(b"garbage")
    status = conservation.check(ledger, remaining=0)
    assert "2 malformed payloads" in status


# --- statistics -----------------------------------------------------------------------


def test_summarize_is_median_min_max() -> None:
    assert summarize([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert summarize([4.0, 1.0]) == (2.5, 1.0, 4.0)
    with pytest.raises(ValueError):
        summarize([])


def test_latency_percentiles_from_hdr() -> None:
    samples = [i / 1e6 for i in range(1, 1001)]  # 1 us .. 1000 us
    p50, p99, p999 = latency_percentiles_ms(samples, [50, 99, 99.9])
    assert p50 == pytest.approx(0.5, rel=0.01)
    assert p99 == pytest.approx(0.99, rel=0.01)
    assert p999 == pytest.approx(0.999, rel=0.01)


def _key(workload: str = "enqueue", broker: str = "fila", batching: str = "none") -> CellKey:
    return CellKey(broker, "durable", batching, workload, 8, 256)  # type: ignore[arg-type]


def test_aggregate_takes_the_median_and_keeps_the_range() -> None:
    key = _key()
    rows = aggregate(Measurement(key, v, "msg/s") for v in (100.0, 300.0, 200.0))
    assert len(rows) == 1
    row = rows[0]
    assert (row.value, row.min, row.max, row.reps, row.conservation) == (200.0, 100.0, 300.0, 3, OK)


def test_aggregate_flags_a_failing_repetition_and_keeps_its_value() -> None:
    key = _key()
    rows = aggregate(
        [
            Measurement(key, 100.0, "msg/s"),
            Measurement(key, 120.0, "msg/s", "failed: 1 lost (e.g. 5)"),
            Measurement(key, None, "msg/s", "error: PhaseError: drain: not finished"),
        ]
    )
    row = rows[0]
    assert row.failed
    assert row.value == 110.0 and row.reps == 2
    assert "rep 2: failed: 1 lost" in row.conservation
    assert "rep 3: error" in row.conservation


def test_aggregate_keeps_not_available_rows_without_a_number() -> None:
    key = _key(batching="native")
    rows = aggregate([Measurement(key, None, "msg/s", f"{NOT_AVAILABLE}: no batching")])
    assert rows[0].value is None and rows[0].reps == 0
    assert not rows[0].available and not rows[0].failed


# --- summary.json and RESULTS.md ------------------------------------------------------


def _summary(rows: list[Row], busy: bool = True) -> Summary:
    machine = {
        "cpu": "test cpu",
        "cpus": 2,
        "memory_gib": 24.0,
        "kernel": "6.x",
        "os": "Debian",
        "fsync_ms": {"p50": 0.2, "p99": 0.4},
        "brokers": {
            "fila": {"title": "Fila", "batching": "SDK batching", "notes": {"durable": ""}},
            "nats": {
                "title": "NATS JetStream",
                "batching": "publish_async",
                "notes": {"durable": "not fsync-durable here"},
            },
        },
        "run": {
            "profile": "quick",
            "reps": 3,
            "command": "python bench-competitive/run.py --quick",
            "loadavg": {"start": 3.1, "end": 4.0},
            "busy": busy,
        },
    }
    return Summary("abc123", "2026-12-01T00:00:00+00:00", machine, "broker on CPU 0", rows)


def _row(
    broker: str, workload: str, connections: int | None, value: float | None, **kw: object
) -> Row:
    fields: dict[str, object] = {
        "broker": broker,
        "mode": "durable",
        "batching": "none",
        "workload": workload,
        "connections": connections,
        "payload_bytes": 256,
        "value": value,
        "unit": "ms" if workload.startswith("latency") else "msg/s",
        "min": value,
        "max": value,
        "reps": 3 if value is not None else 0,
        "conservation": OK,
    }
    fields.update(kw)
    return Row(**fields)  # type: ignore[arg-type]


def _rows() -> list[Row]:
    return [
        _row("fila", "enqueue", 50, 1234.0, min=1000.0, max=1500.0),
        _row("fila", "drain", 50, 900.0),
        _row("fila", "latency_p50", 1, 1.25),
        _row("fila", "enqueue", 1, 500.0),
        _row("fila", "drain", 1, 400.0),
        _row(
            "fila",
            "enqueue",
            1,
            None,
            batching="native",
            conservation=f"{NOT_AVAILABLE}: the installed fila_sdk has no enqueue_many",
        ),
        _row("nats", "enqueue", 50, 700.0, conservation="failed: 3 lost (e.g. 1, 2, 3)"),
        _row("nats", "drain", 50, 650.0),
    ]


def test_summary_has_exactly_the_issue_schema_and_round_trips(tmp_path: Path) -> None:
    summary = _summary(_rows())
    path = tmp_path / "summary.json"
    write(summary, path)
    data = json.loads(path.read_text())
    assert list(data) == list(TOP_LEVEL)
    assert all(list(row) == ROW_FIELDS for row in data["rows"])
    assert read(path) == summary
    assert [r.broker for r in summary.failed] == ["nats"]


def test_markdown_shows_medians_ranges_flags_and_unavailable_cells() -> None:
    text = markdown.render(_summary(_rows()))
    assert "| Fila | 1,234 (1,000-1,500) | 900 (900-900) | 1.250 (1.250-1.250) | - | - |" in text
    assert "700 (700-700) ⚠" in text  # the failed NATS cell is flagged where it stands
    assert "## Failures" in text and "3 lost" in text
    assert "| Fila | durable | n/a | - | SDK batching |" in text
    assert "NATS JetStream †" in text and "† NATS JetStream, durable: not fsync-durable" in text
    assert "**Busy machine**" in text and "3.1 at start" in text
    assert "**Conservation: 1 of 7 rows failed**" in text
    assert "## Not runnable here: published figures" in text
    assert "| 1 | 500 / 400 | - / - |" in text  # throughput against connections


def test_markdown_of_a_clean_quiet_run_says_so() -> None:
    rows = [r for r in _rows() if r.broker == "fila"]
    text = markdown.render(_summary(rows, busy=False))
    assert "Busy machine" not in text and "## Failures" not in text
    assert "every one of the 5 measured rows ended with exact counts" in text


def test_markdown_says_when_a_run_is_not_complete() -> None:
    summary = _summary(_rows())
    summary.machine["run"]["state"] = "interrupted: fila"
    assert "**Not a complete run** (interrupted: fila)" in markdown.render(summary)


def test_published_figures_are_quoted_for_the_brokers_that_cannot_run() -> None:
    brokers = " ".join(q.broker for q in PUBLISHED)
    for name in ("Kafka", "Faktory", "sepp", "bunqueue"):
        assert name in brokers
    assert not {q.broker.lower() for q in PUBLISHED} & set(NAMES)  # never a measured broker


def test_charts_are_png_files(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from competitive.report import charts

    paths = charts.write_all(_summary(_rows()), tmp_path)
    assert len(paths) == 4
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- small pure helpers -----------------------------------------------------------------


def test_netstat_counts_established_connections_to_a_port() -> None:
    lines = [
        "0: 0100007F:9C40 0100007F:1F90 01 00000000:00000000",  # to 8080, established
        "1: 0100007F:9C41 0100007F:1F90 06 00000000:00000000",  # to 8080, time-wait
        "2: 0100007F:1F90 0100007F:9C40 01 00000000:00000000",  # the server side
        "3: 0100007F:9C42 0100007F:1F91 01 00000000:00000000",  # another port
    ]
    assert netstat.count_established(lines, 8080) == 1


def test_profiles_match_the_issue() -> None:
    assert QUICK.connections == (1, 50) and QUICK.reps == 1
    assert FULL.connections == (1, 8, 50) and FULL.reps >= 3
    assert FULL.payload_sizes == (64, 1024, 65_536)
    assert FULL.producers == 3 and FULL.job_bytes == 256


def test_cli_rejects_unknown_brokers_and_modes() -> None:
    assert parse(["--quick", "--brokers", "fila,redis"]).broker_list == ["fila", "redis"]
    with pytest.raises(SystemExit):
        parse(["--brokers", "kafka"])
    with pytest.raises(SystemExit):
        parse(["--modes", "fast"])


def test_every_adapter_describes_both_modes() -> None:
    for name in ("fila",):  # the others need the optional `bench` extra
        cls = load(name)
        assert cls.settings("durable") != cls.settings("buffered")
    with pytest.raises(KeyError):
        load("kafka")


# --- processes ------------------------------------------------------------------------


def _gone(pid: int) -> bool:
    """Exited: no /proc entry, or a zombie waiting for whoever inherited it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


@pytest.fixture
def stray(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A 'broker' (sleep) started as the harness starts one, from a runner that died."""
    workdir = tmp_path / f"{procs.TMP_PREFIX}test-x"
    workdir.mkdir()
    proc = subprocess.Popen(
        ["sleep", "60"], start_new_session=True, env={**os.environ, procs.MARKER: "t:sleep"}
    )
    record = {
        "pid": proc.pid,
        "start": procs.start_time(proc.pid),
        "instance": "t:sleep",
        "runner_pid": 2**22 + 7,  # no such process: the runner is gone
        "runner_start": 1,
    }
    (workdir / procs.RECORD).write_text(json.dumps(record))
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_clean_kills_a_stray_of_a_dead_run_and_removes_its_dir(
    tmp_path: Path, stray: subprocess.Popen[bytes]
) -> None:
    killed, dirs = procs.clean(tmp_path)
    assert stray.pid in killed
    assert stray.wait(5) == -signal.SIGKILL
    assert dirs and not any(d.exists() for d in dirs)


def test_clean_leaves_a_run_in_progress_alone(
    tmp_path: Path, stray: subprocess.Popen[bytes]
) -> None:
    (record_path,) = tmp_path.rglob(procs.RECORD)
    record = json.loads(record_path.read_text())
    record["runner_pid"], record["runner_start"] = os.getpid(), procs.start_time(os.getpid())
    record_path.write_text(json.dumps(record))
    killed, dirs = procs.clean(tmp_path)
    assert killed == [] and dirs == []
    assert stray.poll() is None


def test_broker_process_stops_its_whole_session(tmp_path: Path) -> None:
    spec = procs.LaunchSpec(["sh", "-c", "sleep 60 & sleep 60"], tmp_path)
    broker = procs.BrokerProcess("sh", spec, cpu=None, instance="t:sh")
    broker.start()
    deadline = time.monotonic() + 5
    while len(broker.members()) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)  # the shell forks its child
    members = broker.members()
    assert len(members) >= 2
    broker.terminate(timeout_s=5)
    assert not broker.running
    # The orphaned `sleep` gets SIGKILL from kill_leftovers; the kernel ends it a
    # moment later (on a loaded machine, not always before this line runs).
    wait_until(lambda: all(_gone(p) for p in members), 5, what="the whole session gone")


def test_a_broker_that_exits_fails_readiness_with_its_log(tmp_path: Path) -> None:
    spec = procs.LaunchSpec(["sh", "-c", "echo bad config >&2; exit 3"], tmp_path)
    broker = procs.BrokerProcess("sh", spec, cpu=None, instance="t:exit")
    broker.start()

    async def never() -> bool:
        return False

    with pytest.raises(procs.BrokerStartError, match="bad config"):
        asyncio.run(broker.wait_ready(never, 5, "readiness"))
    broker.terminate(timeout_s=5)


# --- a real Fila cell, and the check catching a sabotaged client ----------------------


TINY = Profile(
    name="test",
    reps=1,
    jobs_by_connections={3: 60},
    latency_rounds=10,
    latency_warmup=2,
    batched_jobs=50,
    payload_sizes=(),
    payload_jobs=0,
    lifecycle_jobs=0,
    multi_producer_jobs=0,
    phase_budget_s=20.0,
    deadline_s=30.0,
    idle_s=1.0,  # a drain short of jobs ends once the broker is empty and quiet this long
)


class _Sabotaged:
    """Wraps a real session: drops every 7th enqueue, or sends every enqueue twice."""

    def __init__(self, inner: Session, fault: str) -> None:
        self._inner = inner
        self._fault = fault
        self._sent = 0

    async def enqueue(self, body: bytes) -> None:
        self._sent += 1
        if self._fault == "lose" and self._sent % 7 == 0:
            return  # claims it was stored
        await self._inner.enqueue(body)
        if self._fault == "duplicate":
            await self._inner.enqueue(body)

    async def reserve(self) -> Delivery:
        return await self._inner.reserve()

    async def ack(self, delivery: Delivery) -> None:
        await self._inner.ack(delivery)

    async def close(self) -> None:
        await self._inner.close()


async def _fila_cells(tmp_path: Path, fault: str | None) -> list[Measurement]:
    adapter = Fila("buffered", tmp_path, cpu=None, instance=f"test:{os.getpid()}:{fault}")
    if fault is not None:
        real_open = adapter.open_session

        async def sabotaged(queue: str) -> Session:
            return _Sabotaged(await real_open(queue), fault)

        adapter.open_session = sabotaged  # type: ignore[method-assign]
    await adapter.start()
    try:
        matrix = Matrix(TINY, 3, 60, 256)
        out = (await matrix.run(adapter, 1)).measurements
        if fault is None:
            out += (await Batched(TINY, 50).run(adapter, 1)).measurements
        return out
    finally:
        await adapter.stop()


def test_real_fila_cell_passes_conservation(tmp_path: Path) -> None:
    measured = asyncio.run(_fila_cells(tmp_path, None))
    matrix = [m for m in measured if m.key.batching == "none"]
    assert [m.key.workload for m in matrix] == ["enqueue", "drain"]
    assert all(m.status == OK and m.value and m.value > 0 for m in matrix), matrix
    batched = [m for m in measured if m.key.batching == "native"]
    if batch_api_missing() is None:
        assert all(m.status == OK and m.value for m in batched), batched
    else:  # the SDK of SPEC 7 is not installed: said so, no number
        assert all(m.value is None and m.status.startswith(NOT_AVAILABLE) for m in batched)


def test_conservation_catches_a_client_that_loses_jobs(tmp_path: Path) -> None:
    measured = asyncio.run(_fila_cells(tmp_path, "lose"))
    assert all(m.status.startswith("failed") or m.status.startswith("error") for m in measured)
    assert any("lost" in m.status for m in measured), measured


def test_conservation_catches_a_broker_that_duplicates_jobs(tmp_path: Path) -> None:
    measured = asyncio.run(_fila_cells(tmp_path, "duplicate"))
    assert all(m.status.startswith("failed") for m in measured), measured
    assert "delivered more than once" in measured[0].status
    assert "broker still holds" in measured[0].status


# --- install.sh -----------------------------------------------------------------------

INSTALL_SH = Path(__file__).resolve().parent.parent / "bench-competitive" / "install.sh"


@pytest.mark.parametrize("policy_existed", [True, False], ids=["docker-image", "bare"])
def test_install_sh_exits_0_after_a_good_install(tmp_path: Path, policy_existed: bool) -> None:
    """With fake `apt-get` and `id` alone on PATH: the install succeeds, the script says
    so with exit 0, and policy-rc.d is left as it was found (kept, or removed again)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    fakes = {
        "id": "#!/bin/sh\necho 0\n",
        "apt-get": f'#!/bin/sh\necho "$@" >> {calls}\n',
    }
    for name, text in fakes.items():
        (bin_dir / name).write_text(text, encoding="utf-8")
        (bin_dir / name).chmod(0o755)
    for tool in ("chmod", "rm"):
        (bin_dir / tool).symlink_to(f"/bin/{tool}")
    policy = tmp_path / "policy-rc.d"
    if policy_existed:
        policy.write_text("#!/bin/sh\nexit 101\n", encoding="utf-8")
    result = subprocess.run(
        ["/bin/bash", str(INSTALL_SH), "redis"],
        env={"PATH": str(bin_dir), "FILA_POLICY_RC_D": str(policy)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert "install -y -qq --no-install-recommends redis-server" in calls.read_text()
    assert policy.exists() is policy_existed
