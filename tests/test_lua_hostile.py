"""Hostile Lua against real broker processes: no script may crash, stall or mislead it.

Each hostile script (patterns that backtrack, memory and copying bombs, long scans,
escape attempts, results that are not valid UTF-8 or not usable at all; the bodies are
in lua_hostile.lua) goes into its own queue's `on_enqueue` (or `on_failure`). Three
enqueues must cost the broker's event loop at most the 10 ms budget plus request
handling (their median; none more than three budgets; measured as the loop thread's
CPU time, which a busy host changes little), answer OK with the default decision, and
leave the broker serving. The latency test has another client hammer a hostile queue
while one connection measures a healthy queue's enqueue latency, and prints the
figures:

    ./scripts/test.sh tests/test_lua_hostile.py -k latency -s

The broker runs with the circuit breaker effectively off, so every hostile call
really runs the script.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from lupa import lua54
from support import ServerFactory, unique, wait_until
from support.stubs import Fila, connect
from support.timing import TimedConsumer, thread_sched

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, messages_pb2, service_pb2

T = 10.0
BUDGET_S = 0.010
# event-loop CPU one hostile enqueue may cost: the budget, a small margin for the
# last check's window, and the request itself
LOOP_CPU_LIMIT_S = BUDGET_S + 0.006
# what any single hostile enqueue may cost the loop, however busy the host: a call
# that comes near it is a stall in the making, not noise
STALL_LIMIT_S = 3 * BUDGET_S
HANG_DEADLINE_S = 3.0
NO_BREAKER = "[lua]\ncircuit_breaker_threshold = 1000000\n"

ESCAPED = Path(f"/tmp/fila-hostile-escape-{uuid.uuid4().hex}")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess(tmp_path_factory.mktemp("hostile") / "data", config_toml=NO_BREAKER)
    proc.start()
    try:
        yield proc
    finally:
        if proc.running:
            proc.stop()


def on_enqueue(body: str) -> str:
    return f'function on_enqueue(m)\n{body}\nreturn {{ fairness_key = "escaped" }}\nend\n'


A2000 = 'string.rep("a", 2000)'
BIG = 'string.rep("a", 60000)'


# Reaching `return { fairness_key = "escaped" }` means the hostile part neither ran
# long nor was refused: every case must fall back to the default key instead.
def _hostile_cases() -> dict[str, str]:
    """The hostile bodies, from lua_hostile.lua beside this file."""
    runtime = lua54.LuaRuntime(encoding=None)
    table = runtime.execute(Path(__file__).with_name("lua_hostile.lua").read_bytes())
    return {k.decode(): v.decode().replace("{ESCAPED}", str(ESCAPED)) for k, v in table.items()}


HOSTILE = _hostile_cases()


def timed_enqueue(server: ServerProcess, fila: Fila, queue: str, what: str) -> tuple[str, float]:
    """One enqueue; its id and the event-loop CPU it cost."""
    before = thread_sched(server.pid)[0]
    try:
        reply = fila.svc.Enqueue(
            service_pb2.EnqueueRequest(queue=queue, payload=b"h"), timeout=HANG_DEADLINE_S
        )
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and server.running:
            server.kill()  # a stalled loop would fail every later test too
            server.start()
        pytest.fail(f"{what}: enqueue failed: {exc.code()} {exc.details()}")
    return reply.message_id, thread_sched(server.pid)[0] - before


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_script_costs_at_most_its_budget(broker: ServerProcess, case: str) -> None:
    with connect(broker.addr) as fila:
        queue = unique(case.replace("_", "-"))
        fila.create_queue(queue, on_enqueue=on_enqueue(HOSTILE[case]))
        ids, costs = [], []
        for _ in range(3):
            mid, cpu = timed_enqueue(broker, fila, queue, case)
            ids.append(mid)
            costs.append(cpu)
            assert cpu < STALL_LIMIT_S, (
                f"{case}: one enqueue held the event loop for {cpu * 1000:.1f} ms of CPU "
                f"(budget {BUDGET_S * 1000:.0f} ms)"
            )
        # The median of three: the loop thread's CPU time is not immune to a busy
        # host (shared caches and cores run the same code slower, and a virtual
        # machine may count time its host took as run time). During one full suite
        # run single calls cost 16.9 and 20.7 ms; the same cases cost 12.5-15.8 alone.
        typical = statistics.median(costs)
        assert typical < LOOP_CPU_LIMIT_S, (
            f"{case}: enqueues held the event loop for "
            f"{', '.join(f'{c * 1000:.1f}' for c in costs)} ms of CPU "
            f"(budget {BUDGET_S * 1000:.0f} ms)"
        )
        assert broker.running, f"{case}: the broker died"
        with TimedConsumer(fila.channel, queue, auto_ack=True) as consumer:
            got = {m.id: m for m in consumer.take(3, T)}
        assert sorted(got) == sorted(ids)
        for message in got.values():
            assert message.metadata.fairness_key == "default", (case, message.metadata)
        assert not ESCAPED.exists(), f"{case}: the script reached the file system"


HOSTILE_FAILURE = {
    "pattern": f'string.find({A2000}, "a*" .. string.rep("a", 1000) .. "b")',
    "error_scan": 'for i = 1, 1e9 do local _ = m.error:find("(.-)x$") end',
    "memory": "local s = m.error:rep(2^20)",
    "loop": "while true do end",
}
NACK_ERROR = "e" * 200_000


def timed_nack(fila: Fila, server: ServerProcess, queue: str, mid: str) -> float:
    before = thread_sched(server.pid)[0]
    fila.svc.Nack(
        service_pb2.NackRequest(queue=queue, message_id=mid, error=NACK_ERROR),
        timeout=HANG_DEADLINE_S,
    )
    return thread_sched(server.pid)[0] - before


@pytest.mark.parametrize("case", sorted(HOSTILE_FAILURE))
def test_hostile_on_failure_retries_by_default(broker: ServerProcess, case: str) -> None:
    """A hostile on_failure costs at most its budget more than a nack without a hook,
    the Nack answers OK, and the message is retried at once (the default decision)."""
    script = f'function on_failure(m)\n{HOSTILE_FAILURE[case]}\nreturn {{ action = "dlq" }}\nend\n'
    with connect(broker.addr) as fila:
        plain, queue = unique("plain"), unique("fail-" + case.replace("_", "-"))
        fila.create_queue(plain)
        fila.create_queue(queue, on_failure=script)
        costs: dict[str, list[float]] = {plain: [], queue: []}
        for name in (plain, queue):
            mid = fila.enqueue(name, b"x")
            with TimedConsumer(fila.channel, name) as consumer:
                for attempt in range(3):
                    _, message = consumer.get(T)
                    assert message.id == mid and message.metadata.attempt_count == attempt
                    costs[name].append(timed_nack(fila, broker, name, mid))
                consumer.get(T)
                fila.ack(name, mid)
        extra = min(costs[queue]) - min(costs[plain])
        assert extra < LOOP_CPU_LIMIT_S, (
            f"{case}: a nack cost the loop {extra * 1000:.1f} ms more than without a hook"
        )
        assert broker.running


# ------------------------------------------------------------------------- latency

HAMMERED = {
    "loop": "while true do end",
    "pattern": f'string.find({A2000}, "a*" .. string.rep("a", 1000) .. "b")',
    "memory": 'local t = {} while true do t[#t + 1] = string.rep("x", 1000) end',
}


def _hammer(addr: str, queue: str, stop: threading.Event, calls: list[str]) -> None:
    with connect(addr) as fila:
        while not stop.is_set():
            fila.svc.Enqueue(service_pb2.EnqueueRequest(queue=queue, payload=b"h"), timeout=T)
            calls.append(queue)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _measure(fila: Fila, server: ServerProcess, count: int) -> tuple[list[float], list[float]]:
    """Wall time and event-loop CPU of `count` healthy enqueues on one connection."""
    wall, loop = [], []
    for _ in range(count):
        cpu0 = thread_sched(server.pid)[0]
        began = time.perf_counter()
        fila.svc.Enqueue(service_pb2.EnqueueRequest(queue="healthy", payload=b"l"), timeout=T)
        wall.append(time.perf_counter() - began)
        loop.append(thread_sched(server.pid)[0] - cpu0)
    return wall, loop


@pytest.mark.parametrize("kind", sorted(HAMMERED))
def test_other_queues_latency_while_hostile_hooks_run(
    server_factory: ServerFactory, kind: str
) -> None:
    """One client hammers a queue whose hook loops, backtracks or exhausts memory; one
    connection enqueues to a well-behaved queue and times each call. A healthy enqueue
    waits for at most about one hostile call, so its p99 must stay under the budget
    plus 20 ms. Measured twice: in wall time, and in event-loop CPU spent between send
    and answer (what it waited behind, whatever the host's load). The wall bound holds
    when the host is not oversubscribed (the loop waited for a CPU under 20% of the
    time), stretched by the share it waited; the loop-CPU bound always. `buffer` mode,
    so the disk's fsync time is not in the figures. Run with -s to see them."""
    server = server_factory(config_toml=NO_BREAKER, persist_mode="buffer")
    with connect(server.addr) as fila:
        fila.create_queue("hostile", on_enqueue=on_enqueue(HAMMERED[kind]))
        fila.create_queue(
            "healthy", on_enqueue='function on_enqueue(m) return { fairness_key = "ok" } end'
        )
        quiet_wall, _ = _measure(fila, server, 200)
        stop = threading.Event()
        calls: list[str] = []
        hammer = threading.Thread(
            target=_hammer, args=(server.addr, "hostile", stop, calls), daemon=True
        )
        hammer.start()
        try:
            wait_until(lambda: len(calls) >= 5, T, what="hostile hammer running")
            hostile_before = len(calls)
            run0, wait0 = thread_sched(server.pid)
            wall, loop = _measure(fila, server, 300)
            run1, wait1 = thread_sched(server.pid)
            hostile_calls = len(calls) - hostile_before
        finally:
            stop.set()
            hammer.join(T)
        assert server.running
        with TimedConsumer(fila.channel, "hostile", auto_ack=True) as consumer:
            keys = {m.metadata.fairness_key for m in consumer.take(5, T)}
        assert keys == {"default"}, keys

    def ms(v: float) -> str:
        return f"{v * 1000:.1f} ms"

    wait_share = (wait1 - wait0) / max(1e-9, (run1 - run0) + (wait1 - wait0))
    figures = (
        f"[{kind}] healthy enqueue, one connection: quiet p50 {ms(statistics.median(quiet_wall))} "
        f"p99 {ms(_percentile(quiet_wall, 0.99))}; with {hostile_calls} hostile calls "
        f"alongside (budget {BUDGET_S * 1000:.0f} ms): p50 {ms(statistics.median(wall))} "
        f"p99 {ms(_percentile(wall, 0.99))} max {ms(max(wall))}; loop CPU waited behind "
        f"p99 {ms(_percentile(loop, 0.99))}; loop waited for a CPU {wait_share:.0%} of the time"
    )
    print("\n" + figures)
    assert hostile_calls >= 30, figures
    assert _percentile(loop, 0.99) < BUDGET_S + 0.020, figures
    if wait_share < 0.2:
        # a loop that had the CPU only (1 - wait_share) of the time takes that much
        # longer in wall time for the same work (16% waiting put one run's p99 at
        # 30.2 ms)
        assert _percentile(wall, 0.99) < (BUDGET_S + 0.020) / (1 - wait_share), figures


def test_messages_from_hostile_queues_stay_consistent(broker: ServerProcess) -> None:
    """After hostile hooks ran, the hostile queues hold exactly what was enqueued."""
    with connect(broker.addr) as fila:
        queue = unique("consistent")
        fila.create_queue(queue, on_enqueue=on_enqueue(HOSTILE["issue_find"]))
        ids = {fila.enqueue(queue, b"c") for _ in range(5)}
        stats = fila.stats(queue)
        assert stats.depth == 5
        with TimedConsumer(fila.channel, queue, auto_ack=True) as consumer:
            got: list[messages_pb2.Message] = consumer.take(5, T)
        assert {m.id for m in got} == ids
        fila.admin.DeleteQueue(admin_pb2.DeleteQueueRequest(queue=queue), timeout=T)
