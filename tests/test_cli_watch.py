"""Watch mode (`queue list --watch`, `queue inspect NAME --watch`): refreshed views with
rates from the broker's counters, bounded here by the hidden `--iterations`."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from support import ServerFactory, unique
from support.cli import Running, fila, run_in_terminal

from fila.cli.rates import Sample, per_second, rates
from fila.testing.server import ServerProcess
from fila_sdk import Client, FairnessKeyStats, QueueStats

DEADLINE_S = 30.0
FAST = ("--interval", "0.2")


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.addr) as c:
        yield c


class Producer:
    """Enqueues to a queue on a thread until stopped, so every interval has arrivals."""

    def __init__(self, addr: str, queue: str) -> None:
        self._stop = threading.Event()
        self._addr, self._queue = addr, queue
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with Client(self._addr) as client:
            while not self._stop.is_set():
                client.enqueue(self._queue, {"tenant": "t"}, b"x")

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_list_watch_json_lines_carry_rates(server_factory: ServerFactory) -> None:
    server = server_factory(persist_mode="buffer")  # arrivals not paced by a busy disk
    name = unique("wl")
    with Client(server.addr) as client:
        client.create_queue(name)
    args = ("--addr", server.addr, "queue", "list", "--watch", *FAST, "--iterations", "3")
    with Producer(server.addr, name), Running(*args, "--json") as run:
        frames = [json.loads(run.stdout.next(DEADLINE_S)) for _ in range(3)]
        assert run.wait() == 0
        assert run.stdout.rest() == []
    rows = [next(q for q in frame if q["name"] == name) for frame in frames]
    assert rows[0]["rates"] == {c: None for c in rows[0]["rates"]}  # no earlier sample yet
    assert all(isinstance(row["rates"]["enqueued"], float) for row in rows[1:]), rows
    assert any(row["rates"]["enqueued"] > 0 for row in rows[1:]), rows
    assert rows[2]["depth"] > rows[0]["depth"]
    assert {"name", "depth", "in_flight", "active_consumers"} <= rows[0].keys()


def test_inspect_watch_prints_every_refresh(server: ServerProcess, client: Client) -> None:
    """Off a terminal (here, captured output), each refresh is printed in turn."""
    name = unique("wi")
    client.create_queue(name)
    client.enqueue(name, None, b"x")
    result = fila(server, "queue", "inspect", name, "-w", *FAST, "--iterations", "2")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.count("since broker start") == 2
    assert result.stdout.count("per second") == 2
    assert "enqueued" in result.stdout and "deliv/s" in result.stdout


def test_inspect_watch_json_has_key_rates(server: ServerProcess, client: Client) -> None:
    name = unique("wj")
    client.create_queue(name)
    result = fila(server, "queue", "inspect", name, "--watch", *FAST, "--iterations", "2", "--json")
    assert result.exit_code == 0, result.stderr
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert first["name"] == name and first["rates"]["enqueued"] is None
    assert second["rates"]["enqueued"] == 0.0 and second["rates"]["per_key_delivered"] == {}


def test_watch_redraws_in_place_on_a_terminal(server: ServerProcess, client: Client) -> None:
    name = unique("wt")
    client.create_queue(name)
    args = ("--addr", server.addr, "queue", "list", "--watch", *FAST, "--iterations", "3")
    status, out, err = run_in_terminal(*args, stdout_terminal=True)
    assert status == 0, err
    assert out.count(name) >= 3  # drawn once per refresh
    assert "\x1b[" in out  # cursor movements: redrawn in place, not appended


def test_watch_stops_on_ctrl_c(server: ServerProcess) -> None:
    with Running("--addr", server.addr, "queue", "list", "--watch", "--json") as run:
        run.stdout.next(DEADLINE_S)
        assert run.interrupt() == 0
        assert run.stderr.rest() == []


def test_watch_rides_out_a_broker_restart(server: ServerProcess) -> None:
    with Running("--addr", server.addr, "queue", "list", "--watch", *FAST, "--json") as run:
        json.loads(run.stdout.next(DEADLINE_S))
        server.stop()
        warning = run.stderr.next(DEADLINE_S)
        assert warning.startswith("fila: warning: broker unreachable"), warning
        assert "retrying every 0.2s" in warning
        server.start()
        # Frames flow again once the broker is back; the process never exited.
        json.loads(run.stdout.next(DEADLINE_S))
        assert run.proc.poll() is None
        assert run.interrupt() == 0


def test_watch_needs_a_queue_that_exists(server: ServerProcess) -> None:
    absent = unique("absent")
    result = fila(server, "queue", "inspect", absent, "--watch", "--iterations", "2")
    assert result.exit_code == 1
    assert result.stderr == f'fila: error: queue "{absent}" not found\n'


def _stats(enqueued: int, delivered: int, keys: dict[str, int]) -> QueueStats:
    return QueueStats(
        depth=0,
        in_flight=0,
        active_fairness_keys=len(keys),
        active_consumers=0,
        quantum=1,
        per_key=tuple(FairnessKeyStats(k, 1, 0, 1, d) for k, d in keys.items()),
        per_throttle=(),
        enqueued_total=enqueued,
        delivered_total=delivered,
    )


def test_rates_from_two_samples() -> None:
    before = Sample(10.0, _stats(100, 40, {"a": 30, "b": 10}))
    after = Sample(12.0, _stats(120, 60, {"a": 45, "b": 15, "c": 0}))
    got = rates(before, after)
    assert got.counters["enqueued"] == 10.0 and got.counters["delivered"] == 10.0
    assert got.counters["acked"] == 0.0
    assert got.per_key == {"a": 7.5, "b": 2.5, "c": None}  # c has no earlier sample
    assert got.share("a") == 0.75 and got.share("c") is None
    first = rates(None, after)
    assert set(first.counters.values()) == {None}


def test_a_counter_that_went_back_has_no_rate() -> None:
    """The broker restarted between samples: its counters began again at 0."""
    assert per_second(500, 20, 1.0) is None
    assert per_second(5, 5, 0.0) is None
    restarted = rates(Sample(1.0, _stats(500, 400, {})), Sample(2.0, _stats(20, 10, {})))
    assert restarted.counters["enqueued"] is None and restarted.counters["acked"] == 0.0
