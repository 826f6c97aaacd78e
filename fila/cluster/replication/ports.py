"""What the replication protocol (`replicator.Replicator`) needs from the world, as
small interfaces, and the values that cross them.

The protocol never awaits. It asks (`Coordinator.propose`, `Transport.send`,
`Store.apply`, `Host.promote`, ...) and is told the outcome later, as an event
(`Replicator.decided`, `received`, `applied`). The broker implements the ports with
etcd, gRPC streams, the group committer and the core (`fila.cluster.replication.node`
and its neighbours); the property tests implement them in memory, with a network that
loses and reorders messages and an etcd whose answers can be late or lost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from fila.cluster.layout import Placement
from fila.cluster.replication.messages import Message, Ops
from fila.cluster.replication.position import Position
from fila.core.errors import BrokerError


@dataclass(frozen=True, slots=True)
class Proposal:
    """Replace `group`'s record `expected` (None: absent) by `record` in one etcd
    transaction, which fails if the record is no longer `expected`; with
    `leader_gone` = (node id, lease), if that node's membership key still holds that
    lease (the leader it replaces is alive after all); and unless every membership key
    in `members_on` ((node id, lease) pairs) still holds its lease: the replicas an ISR
    addition found caught up, as the incarnations that caught up (a replica restarted
    meanwhile, its disk lost perhaps, is on a new lease: Kafka's KIP-903 case)."""

    group: str
    token: int
    expected: Placement | None
    record: Placement
    leader_gone: tuple[int, int] | None = None
    members_on: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class Outcome:
    """The answer to a proposal: whether it was applied, and the record etcd holds
    now (`known` False: etcd did not answer, and the proposal may or may not have been
    applied; the watch will tell)."""

    token: int
    succeeded: bool
    record: Placement | None
    known: bool = True


class Coordinator(Protocol):
    def propose(self, proposal: Proposal) -> None:
        """Answered with `Replicator.decided(proposal.group, outcome)`."""
        ...


class Transport(Protocol):
    def send(self, node_id: int, message: Message) -> None:
        """Best effort: a message may be lost (the protocol notices and asks again)."""
        ...


class Store(Protocol):
    """The node's own copies of the queues it follows, with their positions."""

    def positions(self) -> dict[str, Position]:
        """Every queue this node holds a replica of (read once, at start)."""
        ...

    def apply(self, group: str, ops: Ops, position: Position) -> None:
        """Writes a batch and the position after it; once durable,
        `Replicator.applied(group, position.seq)`."""
        ...

    def record(self, group: str, position: Position) -> None:
        """Writes the position alone (a leader starting its epoch, an empty replica);
        no answer."""
        ...

    def begin_snapshot(self, group: str) -> None:
        """Drops the replica's state of `group` and marks it incomplete."""
        ...

    def add_snapshot(self, group: str, ops: Ops) -> None: ...

    def end_snapshot(self, group: str, position: Position) -> None:
        """The snapshot is whole at `position`; once durable, `Replicator.applied`."""
        ...

    def drop(self, group: str) -> None:
        """Forgets the replica: its keys and its position (the queue was deleted, or
        this node no longer holds a replica of it)."""
        ...


class Host(Protocol):
    """The broker, as the protocol sees it."""

    def promote(self, group: str) -> None:
        """This node leads `group` from now on: serve it from the local replica
        (its queues rebuilt from storage as a restart would)."""
        ...

    def demote(self, group: str) -> None:
        """This node no longer leads `group`: stop serving it, keep its storage.
        Writes made for it so far reach `Replicator.written` first."""
        ...

    def snapshot(self, group: str) -> Iterator[Ops]:
        """The queue's whole stored state as of now (when the call is made), in
        chunks read as the iterator is advanced."""
        ...


class Fence(Protocol):
    """This node's etcd lease (`fila.cluster.lease`)."""

    @property
    def lease(self) -> int:
        """The lease this node's membership key is on (0: none)."""
        ...

    def serving(self) -> bool:
        """Whether the node may serve now (before its local lease deadline)."""
        ...


class Ticket:
    """A leader's write batch of one queue, as its writers wait on it: `answer` is
    called once (None: every in-sync replica holds it and the leader still leads, so
    the clients may be told; an error: they may not, the outcome is unknown), and
    `replicated` when every in-sync replica holds it, even if that is after the
    answer went out as an error (the leader was fenced for a while and then led on
    with the same epoch). A leader that loses the lead drops its tickets: `replicated`
    is never called for them. Callbacks added after the fact run at once."""

    __slots__ = ("_error", "_on_answer", "_on_replicated", "_state", "epoch", "group", "seq")

    _PENDING, _ANSWERED, _REPLICATED = 0, 1, 2

    def __init__(self, group: str, epoch: int, seq: int) -> None:
        self.group = group
        self.epoch = epoch
        self.seq = seq
        self._state = Ticket._PENDING
        self._error: BrokerError | None = None
        self._on_answer: list[Callable[[BrokerError | None], None]] = []
        self._on_replicated: list[Callable[[], None]] = []

    @property
    def answered(self) -> bool:
        return self._state != Ticket._PENDING

    def when_answered(self, callback: Callable[[BrokerError | None], None]) -> None:
        if self._state == Ticket._PENDING:
            self._on_answer.append(callback)
        else:
            callback(self._error)

    def when_replicated(self, callback: Callable[[], None]) -> None:
        if self._state == Ticket._REPLICATED:
            callback()
        else:
            self._on_replicated.append(callback)

    def answer(self, error: BrokerError | None) -> None:
        if self._state != Ticket._PENDING:
            return
        self._state = Ticket._ANSWERED
        self._error = error
        callbacks, self._on_answer = self._on_answer, []
        for callback in callbacks:
            callback(error)

    def replicate(self) -> None:
        """Every in-sync replica holds the batch (answer it first)."""
        assert self._state == Ticket._ANSWERED, "answer before replicate"
        self._state = Ticket._REPLICATED
        callbacks, self._on_replicated = self._on_replicated, []
        for callback in callbacks:
            callback()
