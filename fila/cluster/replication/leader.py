"""What a leader keeps per queue it leads: its position, log, followers' progress and
the tickets its writers wait on; and the rules that read them (who must hold a batch
before it is answered, who lags). The `Replicator` acts on them."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum

from fila.cluster.replication.log import Log
from fila.cluster.replication.messages import Ops
from fila.cluster.replication.ports import Ticket
from fila.cluster.replication.position import Position


@dataclass(slots=True)
class OutgoingSnapshot:
    """A snapshot being streamed to one follower: the queue's state at `seq`."""

    seq: int
    chunks: Iterator[Ops]
    sent: int = 0  # chunks sent
    acked: int = 0  # chunks the follower says it received (flow control)
    done: bool = False  # every chunk sent, SnapshotEnd too


class Stage(Enum):
    LOG = "log"  # batches from the log; acknowledgements count
    SNAPSHOT_WAIT = "snapshot_wait"  # needs a snapshot, once it has left the in-sync set
    SNAPSHOT = "snapshot"  # a snapshot on its way


@dataclass(slots=True)
class Progress:
    """One follower's session with this leader. A session needs at most one snapshot,
    its first step: a follower whose log runs out later is told to start a new one."""

    session: int
    acked: int  # the follower holds every batch up to here durably (Stage.LOG only)
    sent: int  # batches up to here were sent in this session
    stage: Stage = Stage.LOG
    snapshot: OutgoingSnapshot | None = None
    # False for a replica that says it is not whole (see messages.Subscribe) until it
    # is seen out of the in-sync set: its acknowledgements do not count before.
    trusted: bool = True


@dataclass(slots=True)
class Leading:
    group: str
    epoch: int
    position: Position
    log: Log
    since_ms: int  # when this node took the lead
    followers: dict[int, Progress] = field(default_factory=dict)
    tickets: deque[Ticket] = field(default_factory=deque)
    # Members being added to the in-sync set: waited on from the proposal on.
    pending_add: set[int] = field(default_factory=set)

    def waited_on(self, isr: Iterable[int], me: int) -> set[int]:
        """The replicas every answered batch must be on (besides this node): the
        in-sync set as etcd holds it (a member being removed stays until the record
        says so) and the members being added."""
        members = set(isr) | self.pending_add
        members.discard(me)
        return members

    def acked(self, node_id: int) -> int:
        progress = self.followers.get(node_id)
        if progress is None or progress.stage is not Stage.LOG or not progress.trusted:
            return 0
        return progress.acked

    def committed(self, members: set[int]) -> int:
        """The last batch every member in `members` holds."""
        last = self.position.seq
        for member in members:
            last = min(last, self.acked(member))
        return last

    def held_back_since(self, node_id: int) -> int | None:
        """Since when `node_id` holds back a batch it should have (the oldest it lacks
        was appended then), or None if it has them all."""
        acked = self.acked(node_id)
        if acked >= self.position.seq:
            return None
        entry = self.log.get(acked + 1)
        return max(entry.at_ms, self.since_ms) if entry is not None else self.since_ms
