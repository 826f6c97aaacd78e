"""What a follower keeps per queue it follows: its session with the queue's leader
and a snapshot being received. (Its replica's position is the `Replicator`'s, kept
for every replica this node holds, whatever its role.)"""

from __future__ import annotations

from dataclasses import dataclass

from fila.cluster.replication.position import Position


@dataclass(slots=True)
class IncomingSnapshot:
    target: Position  # where the replica stands once the snapshot is whole
    next_index: int = 0


@dataclass(slots=True)
class Following:
    leader: int
    epoch: int  # the queue's epoch (etcd) when the session began
    session: int
    heard_ms: int  # when the leader last sent anything in this session (-1: nothing yet)
    progress_ms: int  # when the replica last advanced, or was found caught up
    acked_ms: int  # when an Ack (or the Subscribe) last went out
    tail: int = 0  # the leader's last sequence, as it last said
    snapshot: IncomingSnapshot | None = None
    rejected: bool = False
