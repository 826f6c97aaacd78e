"""The replication protocol's messages between nodes, as plain values.

A follower opens a session per queue with the queue's leader (`Subscribe`), saying
where its replica stands; the leader streams what the follower lacks: batches from
its log, or, when its log does not reach back that far or the follower's log
diverged, a snapshot of the queue (`SnapshotBegin`, `SnapshotChunk`...,
`SnapshotEnd`), then batches. The follower acknowledges (`Ack`) the last sequence it
holds durably. Every message names the session, so the answers to an old session
(reordered, or sent before a node restarted) are told apart and dropped, and carries
the leader's epoch: a follower refuses an epoch older than the queue's.

`fila.cluster.replication.wire` maps these to the gRPC messages of
`fila.internal.v1` and back.
"""

from __future__ import annotations

from dataclasses import dataclass

from fila.cluster.replication.position import History

Ops = tuple[tuple[bytes, bytes | None], ...]  # (key, value); None deletes


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Follower -> leader: start session `session` for `group`; my replica's last
    batch is `(epoch, seq)`, durable up to `durable`, and I know the queue to be at
    `known_epoch`. `whole` False: this node has no record of its replica (a new or
    wiped disk) or it may not stand for the in-sync membership etcd gives it
    (`Position.eligible`), so an in-sync set naming it is wrong (it may lack what was
    answered): the leader takes it out before counting it. `partial`: its replica is
    a snapshot cut short, which only a snapshot can complete."""

    group: str
    session: int
    epoch: int
    seq: int
    durable: int
    known_epoch: int
    whole: bool = True
    partial: bool = False


@dataclass(frozen=True, slots=True)
class Ack:
    """Follower -> leader: I hold every batch up to `seq` durably, and `chunks`
    chunks of the snapshot being sent (flow control). Sent after each apply, and again
    every heartbeat (`heartbeat`: answered with a `Tail`), so a lost one is made good."""

    group: str
    session: int
    epoch: int
    seq: int
    chunks: int = 0
    heartbeat: bool = False


@dataclass(frozen=True, slots=True)
class Batch:
    """Leader -> follower: the write batch at `seq`, written in epoch `written` (by
    this leader, or before it, by an earlier one); `epoch` is the sender's."""

    group: str
    session: int
    epoch: int
    seq: int
    ops: Ops
    written: int


@dataclass(frozen=True, slots=True)
class Tail:
    """Leader -> follower, in answer to a heartbeat `Ack`: my last sequence, so a
    follower that lost the last batches notices."""

    group: str
    session: int
    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class SnapshotBegin:
    """Leader -> follower: the queue's whole state at `seq` follows, in chunks; the
    replica's old state of the queue is to be dropped."""

    group: str
    session: int
    epoch: int
    seq: int
    history: History


@dataclass(frozen=True, slots=True)
class SnapshotChunk:
    group: str
    session: int
    epoch: int
    index: int
    ops: Ops


@dataclass(frozen=True, slots=True)
class SnapshotEnd:
    group: str
    session: int
    epoch: int
    chunks: int


@dataclass(frozen=True, slots=True)
class Reject:
    """Leader -> follower: this node does not lead `group` at an epoch the session
    can use (it lost the lead, or restarted): read the record again."""

    group: str
    session: int
    epoch: int


Message = Subscribe | Ack | Batch | Tail | SnapshotBegin | SnapshotChunk | SnapshotEnd | Reject
