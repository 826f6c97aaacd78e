"""Job-queue additions, second round, against a real broker: the retry curve and the
DLQ after `max_attempts` with the failure reason, GetQueue / UpdateQueue (checked
before stored, racing with enqueues, kept across a restart), peek states and the
counts that add up, hook error counters, and the CLI's `queue show|update`,
`peek --state` and `inspect`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from support import ServerFactory, unique, wait_until
from support.cli import ok, ok_json

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc
from fila_sdk import UNLIMITED_ATTEMPTS, Client, InvalidArgumentError

KEYED = 'function on_enqueue(m) return { fairness_key = "%s" } end'
DEADLINE_S = 20.0


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.addr) as c:
        yield c


def test_failed_jobs_retry_on_the_curve_then_land_in_the_dlq_with_their_error(
    client: Client,
) -> None:
    name = unique("curve")
    client.create_queue(name, max_attempts=3)
    message_id = client.enqueue(name, "charge order 9")
    seen: list[float] = []
    for message in client.consume(name):
        seen.append(time.monotonic())
        client.nack(name, message.id, f"card declined ({message.attempt_count + 1})")
        if len(seen) == 3:
            break
    first_wait, second_wait = seen[1] - seen[0], seen[2] - seen[1]
    assert 0.75 <= first_wait <= 1.25 + 0.5, first_wait  # 1 s +-25%, and scheduling
    assert 1.5 <= second_wait <= 2.5 + 0.5, second_wait  # 2 s +-25%
    dlq = f"{name}.dlq"
    wait_until(lambda: client.get_stats(dlq).depth == 1, DEADLINE_S, what="dead-lettered")
    (dead,) = client.peek(dlq).messages
    assert (dead.id, dead.attempt_count, dead.last_error) == (
        message_id,
        3,
        "card declined (3)",
    )
    assert dead.dead_lettered_at is not None and dead.last_failed_at == dead.dead_lettered_at
    assert client.redrive(dlq) == 1
    (back,) = client.peek(name).messages
    assert (back.attempt_count, back.last_error) == (0, "card declined (3)")
    assert back.dead_lettered_at == dead.dead_lettered_at


def test_get_and_update_queue_check_before_storing_and_survive_a_restart(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    name = unique("cfg")
    with Client(server.addr) as client:
        client.create_queue(name)
        details = client.get_queue(name)
        assert (details.name, details.dlq) == (name, f"{name}.dlq")
        config = details.config
        assert (config.visibility_timeout_ms, config.max_attempts, config.retry_backoff) == (
            30_000,
            25,
            "exponential",
        )
        with pytest.raises(InvalidArgumentError, match=r"os\.execute"):
            client.update_queue(name, on_enqueue="function on_enqueue(m) os.execute() end")
        with pytest.raises(InvalidArgumentError, match="retry_backoff"):
            client.update_queue(name, retry_backoff="fixed:never", max_attempts=3)
        assert client.get_queue(name).config == config  # nothing changed
        updated = client.update_queue(
            name, visibility_timeout_ms=5000, retry_backoff="fixed:2s", max_attempts=4
        )
        assert (updated.visibility_timeout_ms, updated.max_attempts, updated.retry_backoff) == (
            5000,
            4,
            "fixed:2s",
        )
        unlimited = client.update_queue(name, max_attempts=UNLIMITED_ATTEMPTS)
        assert unlimited.max_attempts is None
        dlq = client.get_queue(f"{name}.dlq")
        assert dlq.dlq is None
        with pytest.raises(InvalidArgumentError, match="dead-letter queue"):
            client.update_queue(f"{name}.dlq", retry_backoff="none")
        stub = admin_pb2_grpc.FilaAdminStub(grpc.insecure_channel(server.addr))
        with pytest.raises(grpc.RpcError) as refused:
            stub.UpdateQueue(admin_pb2.UpdateQueueRequest(queue=name, update_mask=["name"]))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert 'update_mask names "name"' in (refused.value.details() or "")
    server.stop()
    server.start()
    with Client(server.addr) as client:
        assert client.get_queue(name).config == unlimited


def test_an_update_racing_with_enqueues_applies_to_what_comes_after_its_answer(
    client: Client,
) -> None:
    name = unique("race")
    client.create_queue(name, on_enqueue=KEYED % "before")
    spans: list[tuple[float, float, str]] = []
    stop = threading.Event()

    def produce() -> None:
        with Client(client.settings.target) as producer:
            while not stop.is_set():
                began = time.monotonic()
                message_id = producer.enqueue(name, b"x")
                spans.append((began, time.monotonic(), message_id))

    producers = [threading.Thread(target=produce) for _ in range(2)]
    for thread in producers:
        thread.start()
    wait_until(lambda: len(spans) >= 50, DEADLINE_S, what="enqueues before the update")
    asked = time.monotonic()
    client.update_queue(name, on_enqueue=KEYED % "after")
    answered = time.monotonic()
    wait_until(lambda: spans[-1][0] > answered + 0.1, DEADLINE_S, what="enqueues after")
    stop.set()
    for thread in producers:
        thread.join()
    keys = {m.id: m.fairness_key for m in client.peek_all(name)}
    before = [i for began, done, i in spans if done < asked]
    after = [i for began, done, i in spans if began > answered]
    assert before and after
    assert {keys[i] for i in before} == {"before"}
    assert {keys[i] for i in after} == {"after"}


def test_peek_states_counts_and_the_cli_views(server: ServerProcess, client: Client) -> None:
    name = unique("states")
    failing = 'function on_enqueue(m) if m.headers.bad then error("bad tenant") end return {} end'
    client.create_queue(name, on_enqueue=failing)
    leased_id = client.enqueue(name, "leased")
    ready_id = client.enqueue(name, "ready", headers={"bad": "1"})  # a hook error, then default
    delayed_id = client.enqueue(name, "later", delay=600)
    stream = client.consume(name, prefetch=1)
    assert next(stream).id == leased_id
    page = client.peek(name)
    assert [(m.id, s.state) for m, s in zip(page.messages, page.states, strict=True)] == [
        (leased_id, "leased"),
        (ready_id, "ready"),
        (delayed_id, "delayed"),
    ]
    assert page.states[0].lease_deadline is not None and page.states[2].ready_at is not None
    assert [m.id for m in client.peek(name, state="delayed").messages] == [delayed_id]
    stats = client.get_stats(name)
    assert (stats.depth, stats.ready, stats.delayed, stats.in_flight) == (2, 1, 1, 1)
    assert stats.hook_errors_total == 1 and stats.last_hook_error.endswith("bad tenant")
    assert stats.last_hook_error_at is not None

    shown = ok_json(server, "queue", "peek", name, "--state", "delayed")
    assert [(m["id"], m["state"]) for m in shown] == [(delayed_id, "delayed")]
    assert shown[0]["ready_at"] is not None
    table = ok(server, "queue", "peek", name)
    assert "delayed until" in table and "leased until" in table and "(attempt 1)" in table
    inspected = ok(server, "queue", "inspect", name)
    assert "2 (ready 1, delayed 1)" in inspected and "1 (leased)" in inspected
    assert "hook errors" in inspected and "bad tenant" in inspected
    stream.close()


def test_cli_queue_show_and_update(server: ServerProcess, client: Client) -> None:
    name = unique("cli")
    ok(server, "queue", "create", name, "--max-attempts", "5", "--retry-backoff", "fixed:30s")
    shown = ok_json(server, "queue", "show", name)
    assert (shown["max_attempts"], shown["retry_backoff"], shown["dlq"]) == (
        5,
        "fixed:30s",
        f"{name}.dlq",
    )
    text = ok(server, "queue", "show", name)
    assert "fixed:30s" in text and "30s" in text
    updated = ok_json(
        server, "queue", "update", name, "--visibility-timeout", "2m",
        "--max-attempts", "unlimited", "--on-failure", TO_DLQ,
    )  # fmt: skip
    assert (updated["visibility_timeout_ms"], updated["max_attempts"]) == (120_000, None)
    assert updated["on_failure_script"] == TO_DLQ
    assert "decided by on_failure" in ok(server, "queue", "show", name)
    assert client.get_queue(name).config.on_failure == TO_DLQ


TO_DLQ = 'function on_failure(m) return { action = "dlq" } end'
