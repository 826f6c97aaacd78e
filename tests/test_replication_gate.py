"""The committer's batch hook and gate in cluster mode (`fila.cluster.replication.gate`),
in-process: the hook on a leader of the simulated cluster (tests/support/replication_sim.py),
the gate over tickets made by hand. The process tests (tests/test_replication.py) run
them in real brokers; these pin each rule where a mutant can be seen."""

from __future__ import annotations

import pytest
from support.replication_sim import SimCluster

from fila.cluster.replication.gate import BatchGate, ReplicationHook
from fila.cluster.replication.ports import Ticket
from fila.cluster.replication.position import Position
from fila.core.errors import BrokerError, Unavailable
from fila.storage import keys
from fila.storage.backend import Batch


def _hooked(
    cluster: SimCluster, ops: list[tuple[bytes, bytes | None, str | None]]
) -> tuple[Batch, BatchGate | None]:
    """A committer batch of `ops` (key, value or None to delete, the queue it names),
    handed to node 1's hook as the committer does before its WAL append."""
    batch = Batch()
    tags: list[str | None] = []
    for key, value, queue in ops:
        if value is None:
            batch.delete(key)
        else:
            batch.put(key, value)
        tags.append(queue)
    replicator = cluster.nodes[1].replicator
    assert replicator is not None
    return batch, ReplicationHook(replicator)(batch, tags)


def _position(cluster: SimCluster, group: str) -> Position:
    replicator = cluster.nodes[1].replicator
    assert replicator is not None
    position = replicator.position(group)
    assert position is not None
    return position


def test_each_led_queue_gets_its_part_of_the_batch_in_order_and_its_position_beside_it() -> None:
    """A DLQ's operations ride with its queue; a node's own records (no queue) and a
    queue this node does not lead are not replicated."""
    cluster = SimCluster()
    before = {group: _position(cluster, group).seq for group in ("a", "b")}
    batch, gate = _hooked(
        cluster,
        [
            (b"a1", b"x", "a"),
            (b"node", b"n", None),
            (b"b1", b"y", "b"),
            (b"d1", b"z", "a.dlq"),
            (b"c1", b"w", "c"),
            (b"a0", None, "a"),
        ],
    )
    assert gate is not None
    for group in ("a", "b"):
        position = _position(cluster, group)
        assert position.seq == before[group] + 1
        assert (keys.replica_key(group), position.encode()) in batch.ops
    assert len(batch.ops) == 6 + 2  # the positions come after the operations
    gate.synced()  # the committer's fsync of the batch
    cluster.settle(rounds=3, check=True)
    for follower in (2, 3):
        disk = cluster.nodes[follower].disk
        assert disk.batches["a"][-1][2] == ((b"a1", b"x"), (b"d1", b"z"), (b"a0", None))
        assert disk.batches["b"][-1][2] == ((b"b1", b"y"),)


def test_a_batch_with_nothing_this_node_leads_has_no_gate_and_is_left_as_it_was() -> None:
    cluster = SimCluster()
    batch, gate = _hooked(cluster, [(b"node", b"n", None), (b"c1", b"w", "c")])
    assert gate is None
    assert batch.ops == [(b"node", b"n"), (b"c1", b"w")]


def test_the_writers_are_answered_once_every_part_is_and_ready_work_waits_for_it() -> None:
    cluster = SimCluster()
    _, gate = _hooked(cluster, [(b"a1", b"x", "a"), (b"b1", b"y", "b")])
    assert gate is not None
    answers: list[Exception | None] = []
    replicated: list[bool] = []
    gate.when_answered(answers.append)
    gate.when_replicated(lambda: replicated.append(True))

    def part_b(event: tuple[str, int]) -> bool:
        kind, index = event
        return kind == "deliver" and cluster.network[index][2].group == "b"

    cluster.run(10_000, hold=part_b)
    assert answers == [] and replicated == []  # not synced here yet
    gate.synced()
    cluster.run(10_000, hold=part_b)
    for follower in (2, 3):  # part "a" is everywhere; part "b" only here
        assert cluster.nodes[follower].disk.positions["a"].seq == _position(cluster, "a").seq
        assert cluster.nodes[follower].disk.positions["b"].seq < _position(cluster, "b").seq
    assert answers == [] and replicated == []
    cluster.settle(rounds=3)
    assert answers == [None] and replicated == [True]


def _tickets(count: int) -> list[Ticket]:
    return [Ticket(f"q{i}", 1, 10 + i) for i in range(count)]


@pytest.mark.parametrize(
    ("answers_in_order", "expected"),
    [
        ([(2, "first"), (0, "second"), (1, None)], "first"),  # the first error to arrive
        ([(0, None), (2, None), (1, "first")], "first"),  # an error after successes
        ([(1, None), (0, None), (2, None)], None),
    ],
)
def test_the_gate_answers_once_every_ticket_is_with_the_first_error_if_any(
    answers_in_order: list[tuple[int, str | None]], expected: str | None
) -> None:
    # The errors are made here, not at import: tests/test_owed_answers.py looks for
    # every BrokerError alive in the process.
    errors = {"first": Unavailable("first"), "second": BrokerError("second")}
    tickets = _tickets(3)
    gate = BatchGate(tickets, lambda group, seq: None)
    answers: list[Exception | None] = []
    gate.when_answered(answers.append)
    for index, name in answers_in_order:
        assert answers == []
        tickets[index].answer(errors[name] if name else None)
    assert answers == [errors[expected] if expected else None]


def test_the_gate_runs_replicated_work_once_every_ticket_is_replicated() -> None:
    tickets = _tickets(2)
    gate = BatchGate(tickets, lambda group, seq: None)
    ran: list[int] = []
    gate.when_replicated(lambda: ran.append(1))
    for ticket in tickets:
        ticket.answer(None)
    tickets[1].replicate()
    assert ran == []
    tickets[0].replicate()
    assert ran == [1]


def test_synced_tells_the_replicator_each_part_is_durable_here() -> None:
    applied: list[tuple[str, int]] = []
    gate = BatchGate(_tickets(2), lambda group, seq: applied.append((group, seq)))
    gate.synced()
    assert applied == [("q0", 10), ("q1", 11)]
