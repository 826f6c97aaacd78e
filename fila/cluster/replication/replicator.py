"""The replication protocol of one node: Kafka's in-sync replicas on etcd.

Each replicated queue (with its DLQ) has a record in etcd (`fila.cluster.layout.
Placement`): its replicas, its leader and the etcd lease the leader held when it
took the lead, the leader's epoch, and the in-sync set (ISR). The record changes only
by transactions that compare it with the value they replace (`Proposal`), so every
change is made against the state it was decided on, and of two rivals one wins.

The rules, and why they keep every answered write:

- **Acknowledgement.** The leader gives each write batch of the queue the next
  sequence number and streams it to its followers, which apply batches in order and
  acknowledge after their fsync. A batch is answered (`Ticket.answer(None)`) only once
  every member of the ISR holds it, and only while the leader may serve (its lease's
  local deadline, `Fence.serving`): so every answered batch is on every ISR member.
- **Leaving the ISR.** A member that holds back a batch longer than `lag_ms`, or whose
  node is down, or which needs a snapshot, is removed by the leader with a
  transaction; until etcd confirms it, the leader keeps waiting for it. A member being
  added is waited for from the moment the leader proposes it (it holds everything up
  to then), so the ISR in etcd never names a replica that lacks an answered batch.
- **Election.** When the leader's lease is gone from etcd (its node died, was cut off,
  or restarted: a new incarnation), each ISR member with a whole replica proposes
  itself: epoch + 1, the old leader out of the ISR, on the condition that the record
  is unchanged and the old leader's membership key no longer holds the old lease.
  One wins. It holds every answered batch (ISR), and it starts its epoch at its own
  last sequence + 1. No unclean election: with no such member alive, the queue waits.
- **Fencing.** A leader answers nothing, and sends nothing, past its local lease
  deadline, which comes before etcd can expire its lease (`fila.cluster.lease`), so an
  old leader paused or cut off answers nothing after a new one may exist. Followers
  refuse batches of an epoch older than the newest they know.
- **Catch-up.** A follower subscribes with its last batch `(epoch, seq)`. If that is a
  prefix of the leader's log (`position.is_prefix`) and the leader's in-memory log
  reaches back far enough, it gets the missing batches; otherwise (a divergent
  suffix an old leader wrote and nobody acknowledged, or a log that no longer reaches)
  it gets a snapshot of the queue, and an ISR member first leaves the ISR, because the
  snapshot replaces its state. Once it holds everything the leader has, the leader
  adds it back.

The class never awaits and never reads the time but through `clock`: the broker feeds
it from etcd's watch, gRPC streams, the committer and a timer (`tick`); the property
tests feed it from an in-memory cluster (tests/test_replication_protocol.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

from fila.clock import Clock
from fila.cluster.errors import Fenced, LeaderChanged, NoLeader, TakingOver
from fila.cluster.layout import Placement
from fila.cluster.replication.follower import Following, IncomingSnapshot
from fila.cluster.replication.leader import Leading, OutgoingSnapshot, Progress, Stage
from fila.cluster.replication.log import Log
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
from fila.cluster.replication.ports import (
    Coordinator,
    Fence,
    Host,
    Outcome,
    Proposal,
    Store,
    Ticket,
    Transport,
)
from fila.cluster.replication.position import Position, is_prefix
from fila.core.errors import BrokerError

log = logging.getLogger("fila.cluster.replication")

# A proposal that failed (or that etcd did not answer) is made again no sooner than this.
RETRY_MS: Final = 200
LOG_BYTES: Final = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Settings:
    lag_ms: int  # a member holding back a batch longer than this leaves the ISR
    heartbeat_ms: int = 500  # a follower acknowledges at least this often
    resubscribe_ms: int = 2000  # a follower that hears nothing useful this long starts over
    log_bytes: int = LOG_BYTES  # each queue's in-memory log
    window: int = 512  # batches sent to a follower beyond what it acknowledged
    chunk_window: int = 8  # snapshot chunks sent beyond what the follower received


class Replicator:
    def __init__(
        self,
        node_id: int,
        settings: Settings,
        clock: Clock,
        fence: Fence,
        coordinator: Coordinator,
        transport: Transport,
        store: Store,
        host: Host,
        new_id: Callable[[], int],
    ) -> None:
        self.node_id = node_id
        self._settings = settings
        self._clock = clock
        self._fence = fence
        self._coordinator = coordinator
        self._transport = transport
        self._store = store
        self._host = host
        self._new_id = new_id
        self._records: dict[str, Placement] = {}
        self._nodes: dict[int, int] = {}  # live node -> the lease its key is on
        self._positions: dict[str, Position] = {}  # every replica this node holds
        self._durable: dict[str, int] = {}  # follower: durable up to here
        self._logs: dict[str, Log] = {}
        self._leading: dict[str, Leading] = {}
        self._following: dict[str, Following] = {}
        self._leaderless: set[str] = set()
        self._proposals: dict[str, int] = {}  # group -> token of the proposal in flight
        self._retry_at: dict[str, int] = {}
        self._epochs: dict[str, int] = {}  # the newest epoch known per group
        self._started = False

    # -- inputs: cluster state -----------------------------------------------------------

    def start(self) -> None:
        """Reads this node's replicas and acts on the records and nodes known so far
        (call once the etcd state is loaded)."""
        for group, position in self._store.positions().items():
            self._positions[group] = position
            self._durable[group] = position.seq if position.complete else 0
        for group, record in self._records.items():
            if self.node_id in record.isr and group not in self._positions:
                # etcd counts this node in sync, but it holds nothing: its disk was
                # lost (or is new). It must not lead, nor count as in sync, until a
                # leader has taken it out of the ISR (see Position.eligible).
                log.warning(
                    "this node holds no replica of queue %s, which etcd counts in sync "
                    "here: a lost disk? It will catch up before it may lead it",
                    group,
                )
                self._positions[group] = Position(eligible=False)
                self._store.record(group, self._positions[group])
        self._started = True
        for group in sorted(set(self._records) | set(self._positions)):
            self._evaluate(group)

    def record_changed(self, group: str, record: Placement | None) -> None:
        """A queue's record as etcd holds it now (None: gone; records arrive in etcd's
        order). Records of queues that are not replicated are ignored."""
        if record is None or not record.replicated:
            if self._records.pop(group, None) is None and group not in self._positions:
                return
        else:
            self._records[group] = record
            if record.epoch > self._epochs.get(group, 0):
                self._epochs[group] = record.epoch
        if self._started:
            self._evaluate(group)

    def node_changed(self, node_id: int, lease: int | None) -> None:
        """A node's membership key: on `lease`, or gone (None)."""
        if lease is None:
            if self._nodes.pop(node_id, None) is None:
                return
        else:
            if self._nodes.get(node_id) == lease:
                return
            self._nodes[node_id] = lease
        for leading in self._leading.values():
            # Another incarnation (or none): what its predecessor acknowledged says
            # nothing about what it holds now. It starts a new session.
            leading.followers.pop(node_id, None)
        if self._started:
            for group in sorted(self._records):
                self._evaluate(group)

    def lease_changed(self) -> None:
        """This node's own lease changed (it rejoined with a new one)."""
        if self._started:
            for group in sorted(set(self._records) | set(self._leading)):
                self._evaluate(group)

    def connection_lost(self, node_id: int) -> None:
        """The stream to or from `node_id` ended: the sessions with it as leader start
        over at the next tick (its followers' sessions end with their own streams)."""
        for following in self._following.values():
            if following.leader == node_id:
                following.rejected = True

    def decided(self, group: str, outcome: Outcome) -> None:
        """The answer to a proposal (its record has been passed to `record_changed`)."""
        if self._proposals.get(group) != outcome.token:
            return
        del self._proposals[group]
        leading = self._leading.get(group)
        if not outcome.succeeded:
            # Decided on a view that was behind (or etcd did not answer): not again
            # before the watch has had time to bring the news.
            self._retry_at[group] = self._clock.now_ms() + RETRY_MS
        if outcome.known and leading is not None:
            record = self._records.get(group)
            leading.pending_add &= set(record.isr) if record is not None else set()
        self._evaluate(group)

    # -- inputs: time, local writes, durability ------------------------------------------

    def tick(self) -> None:
        """Called every ~100 ms: answers what waits on a fenced leader, sends what
        followers lack, moves members in and out of the ISR, keeps sessions alive,
        retries elections."""
        serving = self._fence.serving()
        for group in list(self._leading):
            if serving:
                self._pump_all(group)
                self._advance(group)
                self._check_isr(group)
            else:
                self._advance(group)
        for group in list(self._following):
            self._follower_timers(group)
        for group in sorted(self._leaderless):
            record = self._records.get(group)
            if record is not None:
                self._elect(group, record)

    def written(self, group: str, ops: Ops) -> Ticket | None:
        """The leader wrote a batch of `group` locally (the committer calls this as
        it writes, and `applied` once it is durable): the batch's ticket, or None if
        this node does not lead `group`."""
        leading = self._leading.get(group)
        if leading is None:
            return None
        seq = leading.position.seq + 1
        leading.position = leading.position.appended(leading.epoch, seq)
        self._positions[group] = leading.position
        leading.log.append(seq, leading.epoch, ops, self._clock.now_ms())
        ticket = Ticket(group, leading.epoch, seq)
        leading.tickets.append(ticket)
        if self._fence.serving():
            for node_id, progress in leading.followers.items():
                if progress.stage is Stage.LOG and progress.sent == seq - 1:
                    self._pump(group, node_id)
        self._advance(group)
        return ticket

    def applied(self, group: str, seq: int) -> None:
        """This node's replica of `group` is durable up to `seq`: a follower's batch
        or snapshot, or a leader's own batch (a leader that becomes a follower says
        how far its replica is durable)."""
        following = self._following.get(group)
        position = self._positions.get(group)
        if position is None or seq > position.seq or not position.complete:
            return  # from before a snapshot replaced the replica
        if seq > self._durable.get(group, 0):
            self._durable[group] = seq
        if following is not None and following.heard_ms >= 0:
            self._ack(group, following)

    # -- inputs: messages --------------------------------------------------------------

    def received(self, sender: int, message: Message) -> None:
        if isinstance(message, Batch):
            self._on_batch(message)
        elif isinstance(message, Ack):
            self._on_ack(sender, message)
        elif isinstance(message, Subscribe):
            self._on_subscribe(sender, message)
        elif isinstance(message, Tail):
            self._on_tail(message)
        elif isinstance(message, SnapshotBegin):
            self._on_snapshot_begin(message)
        elif isinstance(message, SnapshotChunk):
            self._on_snapshot_chunk(message)
        elif isinstance(message, SnapshotEnd):
            self._on_snapshot_end(message)
        else:
            self._on_reject(message)

    # -- queries -----------------------------------------------------------------------

    def serving(self, group: str) -> bool:
        """Whether this node serves `group` now (it leads it and may serve)."""
        return group in self._leading and self._fence.serving()

    def leads(self, group: str) -> bool:
        return group in self._leading

    def unavailable(self, group: str) -> BrokerError:
        """Why `group` is not served here (when `serving` is False and the record names
        this node, or no live leader)."""
        record = self._records.get(group)
        if group in self._leading:
            return Fenced(
                f"node {self.node_id} has lost its etcd lease: queue {group} is unavailable"
            )
        if record is not None and record.node_id == self.node_id and group not in self._leaderless:
            return TakingOver(group, self.node_id)
        waiting = tuple(record.isr) if record is not None else ()
        return NoLeader(group, waiting)

    def record(self, group: str) -> Placement | None:
        return self._records.get(group)

    def position(self, group: str) -> Position | None:
        return self._positions.get(group)

    def follower_lag(self, group: str) -> dict[int, int]:
        """On the leader: batches each other replica lacks (its acknowledged position
        against the leader's last)."""
        leading = self._leading.get(group)
        record = self._records.get(group)
        if leading is None or record is None:
            return {}
        last = leading.position.seq
        return {
            node_id: last - leading.acked(node_id)
            for node_id in record.replicas
            if node_id != self.node_id
        }

    def gauges(self) -> list[tuple[str, int, int, dict[int, int]]]:
        """(queue, replicas, in sync, lag by follower) for each queue led here. Safe to
        call from another thread: it reads copies (one C-level call each)."""
        found = []
        for group, leading in list(self._leading.items()):
            record = self._records.get(group)
            if record is None:
                continue
            last = leading.position.seq
            lag = {
                node_id: max(0, last - leading.acked(node_id))
                for node_id in record.replicas
                if node_id != self.node_id
            }
            found.append((group, len(record.replicas), len(record.isr), lag))
        return found

    def led(self) -> list[str]:
        return sorted(self._leading)

    def followed(self) -> list[str]:
        return sorted(self._following)

    # -- deciding the role ---------------------------------------------------------------

    def _evaluate(self, group: str) -> None:
        record = self._records.get(group)
        me = self.node_id
        if record is None or me not in record.replicas:
            self._stop_leading(group, LeaderChanged(group))
            self._following.pop(group, None)
            self._leaderless.discard(group)
            if group in self._positions:
                log.info("replica dropped: this node no longer holds a copy queue=%s", group)
                self._positions.pop(group)
                self._durable.pop(group, None)
                self._logs.pop(group, None)
                self._store.drop(group)
            return
        position = self._positions.get(group)
        if position is not None and not position.eligible and me not in record.isr:
            position = replace(position, eligible=True)  # out of the ISR: may earn it back
            self._positions[group] = position
            self._store.record(group, position)
        lease = self._fence.lease
        if record.node_id == me and lease and record.leader_lease == lease:
            self._leaderless.discard(group)
            self._following.pop(group, None)
            leading = self._leading.get(group)
            if leading is not None and leading.epoch == record.epoch:
                leading.pending_add -= set(record.isr)
                self._pump_all(group)
                self._advance(group)
                self._check_isr(group)
                return
            self._stop_leading(group, LeaderChanged(group))
            self._lead(group, record)
            return
        self._stop_leading(group, LeaderChanged(group))
        if self._alive(record.node_id, record.leader_lease):
            self._leaderless.discard(group)
            self._follow(group, record)
        else:
            self._leaderless.add(group)
            self._elect(group, record)

    def _alive(self, node_id: int, lease: int) -> bool:
        return lease != 0 and self._nodes.get(node_id) == lease

    def _propose(
        self,
        group: str,
        expected: Placement,
        record: Placement,
        leader_gone: tuple[int, int] | None = None,
        members_on: tuple[tuple[int, int], ...] = (),
    ) -> None:
        token = self._new_id()
        self._proposals[group] = token
        self._coordinator.propose(
            Proposal(
                group,
                token,
                expected,
                replace(record, version=expected.version + 1, raw=b""),
                leader_gone,
                members_on,
            )
        )

    def _may_propose(self, group: str) -> bool:
        return group not in self._proposals and self._clock.now_ms() >= self._retry_at.get(group, 0)

    # -- elections -----------------------------------------------------------------------

    def _elect(self, group: str, record: Placement) -> None:
        """Proposes this node as the leader of `group`, whose leader is gone, if it
        may lead: an ISR member with a whole replica, holding its lease."""
        me = self.node_id
        position = self._positions.get(group)
        lease = self._fence.lease
        if (
            me not in record.isr
            or position is None
            or not position.whole
            or not lease
            or not self._fence.serving()
            or not self._may_propose(group)
        ):
            return
        old = record.node_id
        isr = tuple(sorted((set(record.isr) - {old}) | {me}))
        elected = replace(record, node_id=me, leader_lease=lease, epoch=record.epoch + 1, isr=isr)
        log.info(
            "proposing this node as leader queue=%s epoch=%d (leader %d is gone)",
            group,
            elected.epoch,
            old,
        )
        self._propose(group, record, elected, (old, record.leader_lease))

    # -- leading -------------------------------------------------------------------------

    def _lead(self, group: str, record: Placement) -> None:
        position = self._positions.get(group, Position())
        if not position.history or position.history[-1][0] < record.epoch:
            position = position.started(record.epoch)
        leading = Leading(
            group,
            record.epoch,
            position,
            self._logs.setdefault(group, Log(self._settings.log_bytes)),
            self._clock.now_ms(),
        )
        self._leading[group] = leading
        self._positions[group] = position
        self._store.record(group, position)
        log.info("leading queue=%s epoch=%d seq=%d", group, record.epoch, position.seq)
        self._host.promote(group)

    def _stop_leading(self, group: str, error: BrokerError) -> None:
        if group not in self._leading:
            return
        self._host.demote(group)  # its pending writes come through `written` first
        leading = self._leading.pop(group)
        for ticket in leading.tickets:
            ticket.answer(error)
        log.info("no longer leading queue=%s epoch=%d", group, leading.epoch)

    def _advance(self, group: str) -> None:
        """Answers (and releases) the tickets every ISR member now holds; while this
        node may not serve, answers the rest with an error (they stay pending for
        `replicated`)."""
        leading = self._leading[group]
        record = self._records.get(group)
        isr = record.isr if record is not None else ()
        committed = leading.committed(leading.waited_on(isr, self.node_id))
        serving = self._fence.serving()
        tickets = leading.tickets
        while tickets and tickets[0].seq <= committed:
            ticket = tickets.popleft()
            ticket.answer(None if serving else self._fenced())
            ticket.replicate()
        if not serving:
            for ticket in tickets:
                ticket.answer(self._fenced())

    def _fenced(self) -> Fenced:
        return Fenced(
            f"node {self.node_id} has lost its etcd lease: the outcome is unknown (retry)"
        )

    def _check_isr(self, group: str) -> None:
        """Removes lagging members from the ISR, or adds caught-up replicas."""
        leading = self._leading[group]
        record = self._records.get(group)
        if record is None or not self._fence.serving() or not self._may_propose(group):
            return
        me = self.node_id
        now = self._clock.now_ms()
        for member, session in leading.followers.items():
            if member not in record.isr:
                session.trusted = True  # whatever it holds, it was not counted on
        lagging: set[int] = set()
        for member in record.isr:
            if member == me:
                continue
            progress = leading.followers.get(member)
            if member not in self._nodes or (
                progress is not None and (progress.stage is not Stage.LOG or not progress.trusted)
            ):
                lagging.add(member)
                continue
            since = leading.held_back_since(member)
            if since is not None and now - since > self._settings.lag_ms:
                lagging.add(member)
        if lagging:
            isr = tuple(m for m in record.isr if m not in lagging)
            log.warning(
                "removing replicas from the in-sync set queue=%s nodes=%s",
                group,
                ",".join(str(m) for m in sorted(lagging)),
            )
            self._propose(group, record, replace(record, isr=isr))
            return
        caught_up = [
            member
            for member in record.replicas
            if member != me
            and member not in record.isr
            and member in self._nodes
            and (caught := leading.followers.get(member)) is not None
            and caught.stage is Stage.LOG
            and caught.acked >= leading.position.seq
        ]
        if caught_up:
            leading.pending_add |= set(caught_up)
            isr = tuple(sorted({*record.isr, *caught_up}))
            log.info(
                "adding replicas to the in-sync set queue=%s nodes=%s",
                group,
                ",".join(str(m) for m in caught_up),
            )
            # Only as the incarnations whose sessions caught up: the membership watch
            # can lag a restart, and a session's progress says nothing of a successor.
            members_on = tuple((member, self._nodes[member]) for member in caught_up)
            self._propose(group, record, replace(record, isr=isr), members_on=members_on)

    def _on_subscribe(self, sender: int, message: Subscribe) -> None:
        group = message.group
        leading = self._leading.get(group)
        record = self._records.get(group)
        if (
            leading is None
            or record is None
            or message.known_epoch > leading.epoch
            or sender not in record.replicas
        ):
            epoch = leading.epoch if leading is not None else 0
            self._transport.send(sender, Reject(group, message.session, epoch))
            return
        prefix = is_prefix(leading.position, message.epoch, message.seq)
        progress = Progress(message.session, 0, 0, trusted=message.whole)
        if (
            prefix
            and not message.partial
            and leading.log.reaches(message.seq, leading.position.seq)
        ):
            progress.acked = min(message.durable, message.seq)
            progress.sent = message.seq
        else:
            progress.stage = Stage.SNAPSHOT_WAIT
        leading.followers[sender] = progress
        if progress.stage is Stage.LOG and self._fence.serving():
            # The session's first message: the follower acknowledges only after it.
            self._transport.send(
                sender, Tail(group, message.session, leading.epoch, leading.position.seq)
            )
        self._pump(group, sender)
        self._check_isr(group)
        self._advance(group)

    def _on_ack(self, sender: int, message: Ack) -> None:
        leading = self._leading.get(message.group)
        if leading is None:
            return
        progress = leading.followers.get(sender)
        if progress is None or progress.session != message.session:
            return
        group = message.group
        snapshot = progress.snapshot
        if snapshot is not None:
            snapshot.acked = max(snapshot.acked, message.chunks)
        elif progress.stage is Stage.LOG:
            progress.acked = max(progress.acked, min(message.seq, progress.sent))
        if message.heartbeat and self._fence.serving() and progress.stage is Stage.LOG:
            self._transport.send(
                sender, Tail(group, message.session, leading.epoch, leading.position.seq)
            )
        self._pump(group, sender)
        self._advance(group)
        self._check_isr(group)

    def _pump_all(self, group: str) -> None:
        for node_id in list(self._leading[group].followers):
            self._pump(group, node_id)

    def _pump(self, group: str, node_id: int) -> None:
        """Sends `node_id` what it lacks, within the window: the snapshot it needs
        (once it is out of the ISR), then batches from the log."""
        if not self._fence.serving():
            return
        leading = self._leading[group]
        progress = leading.followers[node_id]
        record = self._records.get(group)
        settings = self._settings
        if progress.stage is Stage.SNAPSHOT_WAIT:
            isr = record.isr if record is not None else ()
            if node_id in leading.waited_on(isr, self.node_id):
                return  # it holds part of what was answered: out of the ISR first
            progress.stage = Stage.SNAPSHOT
            progress.acked = 0
            progress.snapshot = OutgoingSnapshot(
                leading.position.seq, iter(self._host.snapshot(group))
            )
            log.info(
                "sending a snapshot queue=%s to=%d seq=%d", group, node_id, leading.position.seq
            )
            self._transport.send(
                node_id,
                SnapshotBegin(
                    group,
                    progress.session,
                    leading.epoch,
                    leading.position.seq,
                    leading.position.history,
                ),
            )
        snapshot = progress.snapshot
        if snapshot is not None:
            while snapshot.sent - snapshot.acked < settings.chunk_window:
                chunk = next(snapshot.chunks, None)
                if chunk is None:
                    self._transport.send(
                        node_id,
                        SnapshotEnd(group, progress.session, leading.epoch, snapshot.sent),
                    )
                    progress.snapshot = None
                    progress.stage = Stage.LOG
                    progress.sent = snapshot.seq
                    break
                self._transport.send(
                    node_id,
                    SnapshotChunk(group, progress.session, leading.epoch, snapshot.sent, chunk),
                )
                snapshot.sent += 1
            if progress.snapshot is not None:
                return
        last = leading.position.seq
        while progress.sent < last and progress.sent - progress.acked < settings.window:
            entry = leading.log.get(progress.sent + 1)
            if entry is None:  # the log no longer reaches: a new session, with a snapshot
                del leading.followers[node_id]
                self._transport.send(node_id, Reject(group, progress.session, leading.epoch))
                return
            self._transport.send(
                node_id,
                Batch(group, progress.session, leading.epoch, entry.seq, entry.ops, entry.epoch),
            )
            progress.sent = entry.seq

    # -- following -------------------------------------------------------------------------

    def _follow(self, group: str, record: Placement) -> None:
        following = self._following.get(group)
        if (
            following is not None
            and following.leader == record.node_id
            and following.epoch == record.epoch
            and not following.rejected
        ):
            return
        self._subscribe(group, record)

    def _subscribe(self, group: str, record: Placement) -> None:
        position = self._positions.get(group, Position())
        now = self._clock.now_ms()
        session = self._new_id()
        self._following[group] = Following(
            leader=record.node_id,
            epoch=record.epoch,
            session=session,
            heard_ms=-1,  # nothing heard in this session yet: no acknowledgement goes out
            progress_ms=now,
            acked_ms=now,
        )
        whole = group in self._positions and position.whole
        epoch, seq = (position.epoch, position.seq) if position.complete else (0, 0)
        durable = min(self._durable.get(group, 0), seq)
        self._transport.send(
            record.node_id,
            Subscribe(
                group,
                session,
                epoch,
                seq,
                durable,
                max(record.epoch, self._epochs.get(group, 0)),
                whole,
                not position.complete,
            ),
        )

    def _session(self, group: str, session: int, epoch: int) -> Following | None:
        """The follower state a leader's message is for; None for another session or an
        epoch older than the newest known (a deposed leader's)."""
        following = self._following.get(group)
        if following is None or following.session != session:
            return None
        if epoch < self._epochs.get(group, 0):
            return None
        self._epochs[group] = epoch
        return following

    def _heard(self, following: Following) -> None:
        following.heard_ms = self._clock.now_ms()

    def _on_batch(self, message: Batch) -> None:
        group = message.group
        following = self._session(group, message.session, message.epoch)
        if following is None:
            return
        self._heard(following)
        position = self._positions.get(group, Position())
        if following.snapshot is not None or not position.complete:
            self._resubscribe(group)
            return
        if message.seq <= position.seq:
            self._ack(group, following)  # a batch sent again: say what is held
            return
        if message.seq != position.seq + 1:
            self._resubscribe(group)  # one was lost
            return
        position = position.appended(message.written, message.seq)
        self._positions[group] = position
        self._logs.setdefault(group, Log(self._settings.log_bytes)).append(
            message.seq, message.written, message.ops, self._clock.now_ms()
        )
        following.progress_ms = self._clock.now_ms()
        self._store.apply(group, message.ops, position)

    def _on_tail(self, message: Tail) -> None:
        following = self._session(message.group, message.session, message.epoch)
        if following is None:
            return
        first = following.heard_ms < 0
        self._heard(following)
        following.tail = message.seq
        group = message.group
        if message.seq == 0 and group not in self._positions:
            # The leader holds nothing: neither does this replica, and it is whole.
            self._positions[group] = Position()
            self._store.record(group, Position())
        position = self._positions.get(group, Position())
        if position.seq >= message.seq:
            following.progress_ms = self._clock.now_ms()
        if first:
            self._ack(group, following)

    def _on_snapshot_begin(self, message: SnapshotBegin) -> None:
        group = message.group
        following = self._session(group, message.session, message.epoch)
        if following is None:
            return
        self._heard(following)
        self._store.begin_snapshot(group)
        self._positions[group] = Position(0, (), complete=False)
        self._durable[group] = 0
        self._logs.pop(group, None)
        following.snapshot = IncomingSnapshot(Position(message.seq, message.history))
        following.progress_ms = self._clock.now_ms()

    def _on_snapshot_chunk(self, message: SnapshotChunk) -> None:
        group = message.group
        following = self._session(group, message.session, message.epoch)
        if following is None:
            return
        self._heard(following)
        incoming = following.snapshot
        if incoming is None or message.index != incoming.next_index:
            self._resubscribe(group)
            return
        self._store.add_snapshot(group, message.ops)
        incoming.next_index += 1
        following.progress_ms = self._clock.now_ms()
        self._ack(group, following)

    def _on_snapshot_end(self, message: SnapshotEnd) -> None:
        group = message.group
        following = self._session(group, message.session, message.epoch)
        if following is None:
            return
        self._heard(following)
        incoming = following.snapshot
        if incoming is None or message.chunks != incoming.next_index:
            self._resubscribe(group)
            return
        following.snapshot = None
        self._positions[group] = incoming.target
        following.progress_ms = self._clock.now_ms()
        log.info("snapshot installed queue=%s seq=%d", group, incoming.target.seq)
        self._store.end_snapshot(group, incoming.target)

    def _on_reject(self, message: Reject) -> None:
        following = self._following.get(message.group)
        if following is not None and following.session == message.session:
            following.rejected = True

    def _ack(self, group: str, following: Following, *, heartbeat: bool = False) -> None:
        chunks = following.snapshot.next_index if following.snapshot is not None else 0
        self._transport.send(
            following.leader,
            Ack(
                group,
                following.session,
                following.epoch,
                self._durable.get(group, 0),
                chunks,
                heartbeat,
            ),
        )
        following.acked_ms = self._clock.now_ms()

    def _resubscribe(self, group: str) -> None:
        record = self._records.get(group)
        if record is not None and self._alive(record.node_id, record.leader_lease):
            self._subscribe(group, record)

    def _follower_timers(self, group: str) -> None:
        following = self._following[group]
        now = self._clock.now_ms()
        settings = self._settings
        position = self._positions.get(group, Position())
        silent_since = following.heard_ms if following.heard_ms >= 0 else following.acked_ms
        stuck = (
            following.tail > position.seq and now - following.progress_ms > settings.resubscribe_ms
        )
        # A session refused, or whose stream ended, starts over, at most once a heartbeat
        # (its leader may be down for a while: no tight loop of attempts).
        rejected = following.rejected and now - following.acked_ms >= settings.heartbeat_ms
        if rejected or now - silent_since > settings.resubscribe_ms or stuck:
            self._resubscribe(group)
            return
        if following.heard_ms >= 0 and now - following.acked_ms >= settings.heartbeat_ms:
            self._ack(group, following, heartbeat=True)
