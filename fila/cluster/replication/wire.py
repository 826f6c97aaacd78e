"""The protocol's messages (`messages`) to and from `fila.internal.v1`'s frames."""

from __future__ import annotations

from collections.abc import Iterable

from fila.cluster.replication.messages import (
    Ack,
    Batch,
    Message,
    Ops,
    Reject,
    SnapshotBegin,
    SnapshotChunk,
    SnapshotEnd,
    Subscribe,
    Tail,
)
from fila.internal.v1 import replication_pb2 as pb


def follower_item(message: Subscribe | Ack) -> pb.FollowerItem:
    if isinstance(message, Subscribe):
        return pb.FollowerItem(
            subscribe=pb.Subscribe(
                group=message.group,
                session=message.session,
                epoch=message.epoch,
                seq=message.seq,
                durable=message.durable,
                known_epoch=message.known_epoch,
                whole=message.whole,
                partial=message.partial,
            )
        )
    return pb.FollowerItem(
        ack=pb.Ack(
            group=message.group,
            session=message.session,
            epoch=message.epoch,
            seq=message.seq,
            chunks=message.chunks,
            heartbeat=message.heartbeat,
        )
    )


def from_follower(item: pb.FollowerItem) -> Subscribe | Ack | None:
    kind = item.WhichOneof("item")
    if kind == "subscribe":
        s = item.subscribe
        return Subscribe(
            s.group, s.session, s.epoch, s.seq, s.durable, s.known_epoch, s.whole, s.partial
        )
    if kind == "ack":
        a = item.ack
        return Ack(a.group, a.session, a.epoch, a.seq, a.chunks, a.heartbeat)
    return None


def leader_item(message: Message) -> pb.LeaderItem:
    if isinstance(message, Batch):
        return pb.LeaderItem(
            batch=pb.Batch(
                group=message.group,
                session=message.session,
                epoch=message.epoch,
                seq=message.seq,
                ops=_ops(message.ops),
                written=message.written,
            )
        )
    if isinstance(message, Tail):
        return pb.LeaderItem(
            tail=pb.Tail(
                group=message.group, session=message.session, epoch=message.epoch, seq=message.seq
            )
        )
    if isinstance(message, SnapshotBegin):
        return pb.LeaderItem(
            snapshot_begin=pb.SnapshotBegin(
                group=message.group,
                session=message.session,
                epoch=message.epoch,
                seq=message.seq,
                history=[pb.EpochStart(epoch=e, seq=s) for e, s in message.history],
            )
        )
    if isinstance(message, SnapshotChunk):
        return pb.LeaderItem(
            snapshot_chunk=pb.SnapshotChunk(
                group=message.group,
                session=message.session,
                epoch=message.epoch,
                index=message.index,
                ops=_ops(message.ops),
            )
        )
    if isinstance(message, SnapshotEnd):
        return pb.LeaderItem(
            snapshot_end=pb.SnapshotEnd(
                group=message.group,
                session=message.session,
                epoch=message.epoch,
                chunks=message.chunks,
            )
        )
    if isinstance(message, Reject):
        return pb.LeaderItem(
            reject=pb.Reject(group=message.group, session=message.session, epoch=message.epoch)
        )
    raise TypeError(f"not a leader's message: {type(message).__name__}")


def from_leader(item: pb.LeaderItem) -> Message | None:
    kind = item.WhichOneof("item")
    if kind == "batch":
        b = item.batch
        return Batch(b.group, b.session, b.epoch, b.seq, _from_ops(b.ops), b.written)
    if kind == "tail":
        t = item.tail
        return Tail(t.group, t.session, t.epoch, t.seq)
    if kind == "snapshot_begin":
        sb = item.snapshot_begin
        history = tuple((h.epoch, h.seq) for h in sb.history)
        return SnapshotBegin(sb.group, sb.session, sb.epoch, sb.seq, history)
    if kind == "snapshot_chunk":
        c = item.snapshot_chunk
        return SnapshotChunk(c.group, c.session, c.epoch, c.index, _from_ops(c.ops))
    if kind == "snapshot_end":
        e = item.snapshot_end
        return SnapshotEnd(e.group, e.session, e.epoch, e.chunks)
    if kind == "reject":
        r = item.reject
        return Reject(r.group, r.session, r.epoch)
    return None


def _ops(ops: Ops) -> list[pb.Op]:
    return [
        pb.Op(key=key, deleted=True) if value is None else pb.Op(key=key, value=value)
        for key, value in ops
    ]


def _from_ops(ops: Iterable[pb.Op]) -> Ops:
    return tuple((op.key, None if op.deleted else op.value) for op in ops)
