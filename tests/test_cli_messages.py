"""`fila enqueue`, `queue peek`, `queue purge` and `tail` against a real broker."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import unique, wait_until
from support.cli import Running, fails, fila, ok, ok_json, run_in_terminal

from fila.cli import raw
from fila.testing.server import ServerProcess
from fila_sdk import Client, Message

TENANT_KEYS = 'function on_enqueue(m) return { fairness_key = m.headers.tenant or "none" } end'
DEAD_LETTER = 'function on_failure(m) return { action = "dlq" } end'
DEADLINE_S = 20.0


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.addr) as c:
        yield c


def _everything(client: Client, queue: str) -> list[Message]:
    return list(client.peek_all(queue))


def _take(client: Client, queue: str, count: int) -> list[Message]:
    """Lease exactly `count` messages (a stream with that prefetch) and leave them leased."""
    stream = raw.consume(client, queue, prefetch=count)
    taken = [next(stream) for _ in range(count)]
    stream.close()
    return taken


# -- enqueue ---------------------------------------------------------------------


def test_enqueue_payload_forms_headers_and_delay(
    server: ServerProcess, client: Client, tmp_path: Path
) -> None:
    name = unique("enq")
    client.create_queue(name, on_enqueue=TENANT_KEYS)
    out = ok(server, "enqueue", name, "-H", "tenant=acme", "--header", "kind=a=b", "literal")
    assert out.startswith("Enqueued ") and f'to "{name}"' in out
    binary = bytes(range(256))
    (tmp_path / "payload.bin").write_bytes(binary)
    from_file = ok_json(server, "enqueue", name, f"@{tmp_path / 'payload.bin'}")
    from_stdin = json.loads(ok(server, "enqueue", name, "-", "--json", input=b"from\nstdin"))
    delayed = ok_json(server, "enqueue", name, "--delay", "1h30m", "later")
    assert delayed["delay_ms"] == 5_400_000 and from_file["delay_ms"] == 0

    by_id = {m.id: m for m in _everything(client, name)}
    first = next(m for m in by_id.values() if m.payload == b"literal")
    assert first.headers == {"tenant": "acme", "kind": "a=b"}
    assert first.fairness_key == "acme"  # the queue's hook saw the headers
    assert by_id[from_file["message_id"]].payload == binary
    assert by_id[from_stdin["message_id"]].payload == b"from\nstdin"
    assert by_id[delayed["message_id"]].payload == b"later"
    assert "ready in 1h30m" in ok(server, "enqueue", name, "--delay", "90m", "x")

    # The delayed messages count in depth but are not delivered: the consumer gets
    # the three ready ones and then nothing more.
    stats = client.get_stats(name)
    assert stats.depth == 5
    assert {m.payload for m in _take(client, name, 3)} == {b"literal", binary, b"from\nstdin"}


def test_enqueue_delay_is_honoured(server: ServerProcess, client: Client) -> None:
    name = unique("delay")
    client.create_queue(name)
    ok(server, "enqueue", name, "--delay", "600ms", "delayed")
    ok(server, "enqueue", name, "now")
    first, second = _take(client, name, 2)
    assert (first.payload, second.payload) == (b"now", b"delayed")
    assert second.enqueued_at is not None and second.leased_at is not None
    # both stamps come from the broker's clock
    assert (second.leased_at - second.enqueued_at).total_seconds() >= 0.6


def test_enqueue_errors(server: ServerProcess, tmp_path: Path) -> None:
    bad = fails(server, "enqueue", "q", "--delay", "soon", "x", code=2)
    assert "Invalid value for '--delay'" in bad and "250ms, 30s, 5m, 1h30m" in bad
    assert '"3s5" is not a duration' in fails(server, "enqueue", "q", "--delay", "3s5", "x", code=2)
    assert "is not KEY=VALUE" in fails(server, "enqueue", "q", "-H", "tenant", "x", code=2)
    assert "given twice" in fails(server, "enqueue", "q", "-H", "a=1", "-H", "a=2", "x", code=2)
    missing = tmp_path / "nope.bin"
    assert f'cannot read payload file "{missing}"' in fails(server, "enqueue", "q", f"@{missing}")
    absent = unique("absent")
    assert fails(server, "enqueue", absent, "x") == f'fila: error: queue "{absent}" not found'


# -- peek ------------------------------------------------------------------------


def test_peek_shows_messages_in_id_order_with_count_and_key(
    server: ServerProcess, client: Client
) -> None:
    name = unique("peek")
    client.create_queue(name, on_enqueue=TENANT_KEYS)
    ids = [
        client.enqueue(name, {"tenant": "a" if i % 2 else "b"}, f"m{i}".encode()) for i in range(5)
    ]
    shown = ok_json(server, "queue", "peek", name)
    assert [m["id"] for m in shown] == ids
    assert shown[0]["payload"] == "m0" and base64.b64decode(shown[0]["payload_base64"]) == b"m0"
    assert shown[0]["headers"] == {"tenant": "b"} and shown[0]["attempt_count"] == 0
    assert [m["id"] for m in ok_json(server, "queue", "peek", name, "-n", "3")] == ids[:3]
    only_a = ok_json(server, "queue", "peek", name, "--key", "a")
    assert [m["id"] for m in only_a] == ids[1::2]

    table = ok(server, "queue", "peek", name, "--count", "2")
    assert ids[0] in table and ids[1] in table and ids[2] not in table
    assert '"m0"' in table and "tenant=b" in table and "ready" in table
    empty = unique("empty")
    client.create_queue(empty)
    assert ok(server, "queue", "peek", empty) == f'No messages in "{empty}".\n'


def test_peek_on_a_dlq_changes_nothing(server: ServerProcess, client: Client) -> None:
    """Browsing dead letters must not lease them: depth, in-flight and attempt counts stay
    as they were, and a redrive right after moves every one."""
    name = unique("dead")
    dlq = f"{name}.dlq"
    client.create_queue(name, on_failure=DEAD_LETTER)
    for i in range(3):
        client.enqueue(name, None, f"d{i}".encode())
    for message in _take(client, name, 3):
        client.nack(name, message.id, "boom")
    wait_until(lambda: client.get_stats(dlq).depth == 3, DEADLINE_S)
    before = client.get_stats(dlq)
    attempts_before = [m.attempt_count for m in _everything(client, dlq)]

    for _ in range(2):
        shown = ok_json(server, "queue", "peek", dlq)
        assert [m["payload"] for m in shown] == ["d0", "d1", "d2"]
        assert {m["queue"] for m in shown} == {dlq}
        assert all(m["leased_at"] is None for m in shown)

    after = client.get_stats(dlq)
    assert (after.depth, after.in_flight, after.delivered_total) == (
        before.depth,
        before.in_flight,
        before.delivered_total,
    )
    assert [m.attempt_count for m in _everything(client, dlq)] == attempts_before == [1, 1, 1]
    assert client.redrive(dlq) == 3


def test_peek_marks_leased_messages(server: ServerProcess, client: Client) -> None:
    name = unique("leased")
    client.create_queue(name)
    client.enqueue(name, None, b"one")
    client.enqueue(name, None, b"two")
    (leased,) = _take(client, name, 1)
    rows = {m["id"]: m for m in ok_json(server, "queue", "peek", name)}
    assert rows[leased.id]["leased_at"] is not None
    assert [m["leased_at"] is None for m in rows.values()].count(True) == 1
    assert "leased" in ok(server, "queue", "peek", name)


# -- purge -----------------------------------------------------------------------


def test_purge_with_yes_leaves_leased_messages(server: ServerProcess, client: Client) -> None:
    name = unique("purge")
    client.create_queue(name)
    for i in range(4):
        client.enqueue(name, None, f"p{i}".encode())
    ok(server, "enqueue", name, "--delay", "1h", "delayed")
    (leased,) = _take(client, name, 1)
    assert ok(server, "queue", "purge", name, "--yes") == f'Purged 4 message(s) from "{name}"\n'
    assert [m.id for m in _everything(client, name)] == [leased.id]
    client.ack(name, leased.id)  # the lease survived the purge
    assert ok_json(server, "queue", "purge", name, "-y") == {"queue": name, "purged": 0}


def test_purge_without_yes_refuses_when_stdin_is_not_a_terminal(
    server: ServerProcess, client: Client
) -> None:
    name = unique("keep")
    client.create_queue(name)
    client.enqueue(name, None, b"precious")
    line = fails(server, "queue", "purge", name)
    assert f'refusing to purge "{name}" without --yes' in line and "not a terminal" in line
    # even when something is piped in, there is no one at a terminal to confirm
    result = fila(server, "queue", "purge", name, input="y\n")
    assert result.exit_code == 1 and "without --yes" in result.stderr
    assert client.get_stats(name).depth == 1


def test_purge_asks_on_a_terminal(server: ServerProcess, client: Client) -> None:
    name = unique("ask")
    client.create_queue(name)
    client.enqueue(name, None, b"a")
    client.enqueue(name, None, b"b")
    args = ("--addr", server.addr, "queue", "purge", name)

    status, out, err = run_in_terminal(*args, stdin_text=b"n\n")
    assert status == 1 and out == ""
    assert f'Delete the 2 ready and delayed message(s) of "{name}"?' in err
    assert err.rstrip().endswith(f'fila: error: purge of "{name}" cancelled; nothing was deleted')
    assert client.get_stats(name).depth == 2

    status, out, err = run_in_terminal(*args, stdin_text=b"y\n")
    assert status == 0, err
    assert out == f'Purged 2 message(s) from "{name}"\n'
    assert client.get_stats(name).depth == 0


# -- tail ------------------------------------------------------------------------


def _following(run: Running) -> None:
    line = run.stderr.next(DEADLINE_S)
    assert line.startswith("fila: following"), line


def test_tail_prints_arrivals_and_changes_nothing(server: ServerProcess, client: Client) -> None:
    name = unique("tail")
    client.create_queue(name, on_enqueue=TENANT_KEYS)
    backlog = client.enqueue(name, None, b"already there")
    with Running("--addr", server.addr, "tail", name, "--count", "2") as run:
        _following(run)
        first = client.enqueue(name, {"tenant": "acme"}, b"hello")
        lines = [run.stdout.next(DEADLINE_S)]
        second = client.enqueue(name, None, b"bye")  # after the first was shown
        lines.append(run.stdout.next(DEADLINE_S))
        assert run.wait() == 0
    assert first in lines[0] and "key=acme" in lines[0] and "tenant=acme" in lines[0]
    assert '"hello"' in lines[0] and "attempts=0" in lines[0]
    assert second in lines[1] and '"bye"' in lines[1]  # each message once
    assert backlog not in "".join(lines)  # what was there before is not an arrival
    stats = client.get_stats(name)
    assert (stats.depth, stats.in_flight, stats.delivered_total) == (3, 0, 0)


def test_tail_json_lines_and_ctrl_c(server: ServerProcess, client: Client) -> None:
    name = unique("tailj")
    client.create_queue(name)
    with Running("--addr", server.addr, "tail", name, "--json") as run:
        _following(run)
        sent = client.enqueue(name, {"k": "v"}, b"\xff\x00")
        row = json.loads(run.stdout.next(DEADLINE_S))
        assert row["id"] == sent and row["headers"] == {"k": "v"}
        assert row["payload"] is None and base64.b64decode(row["payload_base64"]) == b"\xff\x00"
        assert run.interrupt() == 0
        assert run.stderr.rest() == []  # no traceback, no "Aborted!"


def test_tail_of_a_dlq_shows_new_dead_letters(server: ServerProcess, client: Client) -> None:
    """Dead letters keep the ids they had in their queue, so an arrival in a DLQ can
    sort before what is already there: tail finds it by reading the whole DLQ."""
    name = unique("taild")
    client.create_queue(name, on_failure=DEAD_LETTER)
    older = client.enqueue(name, None, b"dies second")
    newer = client.enqueue(name, None, b"dies first")
    stream = raw.consume(client, name, prefetch=2)
    assert {next(stream).id, next(stream).id} == {older, newer}  # both leased
    client.nack(name, newer, "fatal")
    wait_until(lambda: client.get_stats(f"{name}.dlq").depth == 1, DEADLINE_S)
    with Running("--addr", server.addr, "tail", f"{name}.dlq", "-n", "1") as run:
        _following(run)
        client.nack(name, older, "fatal")
        line = run.stdout.next(DEADLINE_S)
        assert run.wait() == 0
    stream.close()
    assert older in line and "attempts=1" in line and newer not in line


def test_tail_ack_consumes_the_backlog_and_new_messages(
    server: ServerProcess, client: Client
) -> None:
    name = unique("taila")
    client.create_queue(name)
    backlog = client.enqueue(name, None, b"waiting")
    with Running("--addr", server.addr, "tail", name, "--ack", "--count", "2", "--json") as run:
        _following(run)
        assert json.loads(run.stdout.next(DEADLINE_S))["id"] == backlog
        fresh = client.enqueue(name, None, b"fresh")
        assert json.loads(run.stdout.next(DEADLINE_S))["id"] == fresh
        assert run.wait() == 0
    wait_until(lambda: client.get_stats(name).acked_total == 2, DEADLINE_S)
    stats = client.get_stats(name)
    assert (stats.depth, stats.in_flight) == (0, 0)


def test_tail_ack_count_takes_exactly_that_many(server: ServerProcess, client: Client) -> None:
    """--ack --count 3 with more waiting: three printed and acked, none left leased."""
    name = unique("tailn")
    client.create_queue(name)
    for i in range(5):
        client.enqueue(name, None, f"m{i}".encode())
    with Running("--addr", server.addr, "tail", name, "--ack", "--count", "3", "--json") as run:
        _following(run)
        printed = [json.loads(run.stdout.next(DEADLINE_S))["payload"] for _ in range(3)]
        assert run.wait() == 0
    assert printed == ["m0", "m1", "m2"]
    wait_until(lambda: client.get_stats(name).acked_total == 3, DEADLINE_S)
    stats = client.get_stats(name)
    assert (stats.depth, stats.in_flight) == (2, 0)


def test_tail_ack_holds_one_message_at_a_time(server: ServerProcess, client: Client) -> None:
    """Ctrl-C during --ack leaves at most the message being printed leased."""
    name = unique("tail1")
    client.create_queue(name)
    for i in range(20):
        client.enqueue(name, None, f"m{i}".encode())
    with Running("--addr", server.addr, "tail", name, "--ack") as run:
        _following(run)
        run.stdout.next(DEADLINE_S)
        assert run.interrupt() == 0
    stats = client.get_stats(name)
    assert stats.in_flight <= 1 and stats.depth + stats.in_flight + stats.acked_total == 20
