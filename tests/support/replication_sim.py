"""An in-memory cluster for the replication protocol: the real `Replicator` on every
node, with an etcd, a network, disks and clients made of dicts and lists, and one
virtual clock.

Nothing happens by itself: a test (tests/test_replication_protocol.py) decides each
step, such as delivering one message (any of those in flight, so messages are
reordered), losing one, letting time pass, killing, pausing or wiping a node,
cutting a link. The cluster records what clients were told (acknowledged batches)
and what the protocol did (who led which epoch), and `check` states the invariants.

The model, and what it leaves out:
- etcd applies a transaction when the request is delivered, atomically; answers and
  watch events travel back like messages (late, or lost when the node is cut off).
  Each node's view of etcd is fed in revision order (as `fila.cluster.mirror` does).
- A node renews its lease on every step it is up, reachable and not paused; etcd
  expires it `TTL` after the last renewal it received; the node's own deadline is the
  same instant (the real node's comes earlier, see `fila.cluster.lease`).
- A disk keeps everything written to it across kills (a kill -9: the WAL append
  survives); `applied` answers come one step later, and a kill loses them. `wipe`
  loses the disk.
- Batches carry their identity `(epoch, seq)` and operations in each replica's log
  list, and snapshots carry that list along as a pseudo-key, so the checks can tell
  which batches each replica holds.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from fila.cluster.layout import Placement
from fila.cluster.replication.messages import Ack, Message, Ops, Subscribe
from fila.cluster.replication.ports import Outcome, Proposal, Ticket
from fila.cluster.replication.position import Position
from fila.cluster.replication.removal import lost_with
from fila.cluster.replication.replicator import Replicator, Settings
from fila.core.errors import BrokerError

TTL_MS = 2000
LOG_KEY = b"\x00log"  # the pseudo-key a snapshot carries the replica's batch list in

BatchId = tuple[int, int]  # (epoch, seq)


class SimClock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def now_ms(self) -> int:
        return self.ms

    def now_s(self) -> float:
        return self.ms / 1000


# -- etcd ---------------------------------------------------------------------------------


@dataclass
class Change:
    revision: int
    kind: str  # "node" or "queue"
    name: Any
    value: Any  # lease (node) or Placement (queue); None: deleted


class SimEtcd:
    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.revision = 1
        self.nodes: dict[int, int] = {}  # node -> lease its key is on
        self.queues: dict[str, Placement] = {}
        self.leases: dict[int, int] = {}  # lease -> expiry ms
        self.changes: list[Change] = []
        self._lease_ids = itertools.count(100)
        self.epochs: dict[str, list[int]] = {}
        self.history: list[tuple[str, Placement]] = []  # every record etcd held, in order

    def _changed(self, kind: str, name: Any, value: Any) -> None:
        self.revision += 1
        self.changes.append(Change(self.revision, kind, name, value))

    def grant(self) -> int:
        lease = next(self._lease_ids)
        self.leases[lease] = self.clock.ms + TTL_MS
        return lease

    def join(self, node_id: int, lease: int) -> None:
        self.nodes[node_id] = lease
        self._changed("node", node_id, lease)

    def renew(self, lease: int) -> bool:
        if lease not in self.leases:
            return False
        self.leases[lease] = self.clock.ms + TTL_MS
        return True

    def revoke(self, lease: int) -> None:
        self.leases.pop(lease, None)
        for node_id, held in list(self.nodes.items()):
            if held == lease:
                del self.nodes[node_id]
                self._changed("node", node_id, None)

    def expire(self) -> None:
        for lease, expiry in list(self.leases.items()):
            if expiry <= self.clock.ms:
                self.revoke(lease)

    def put_queue(self, group: str, record: Placement) -> None:
        epochs = self.epochs.setdefault(group, [])
        assert not epochs or record.epoch >= epochs[-1], "an epoch went back in etcd"
        epochs.append(record.epoch)
        self.history.append((group, record))
        self.queues[group] = record
        self._changed("queue", group, record)

    def delete_queue(self, group: str) -> None:
        del self.queues[group]
        self._changed("queue", group, None)

    def transact(self, proposal: Proposal) -> tuple[bool, Placement | None, int]:
        current = self.queues.get(proposal.group)
        ok = current == proposal.expected
        if ok and proposal.leader_gone is not None:
            node_id, lease = proposal.leader_gone
            ok = self.nodes.get(node_id) != lease
        ok = ok and all(self.nodes.get(node) == lease for node, lease in proposal.members_on)
        if ok:
            self.put_queue(proposal.group, proposal.record)
            return True, proposal.record, self.revision
        return False, current, self.revision


# -- disks ------------------------------------------------------------------------------------


@dataclass
class DiskState:
    data: dict[str, dict[bytes, bytes]] = field(default_factory=dict)
    positions: dict[str, Position] = field(default_factory=dict)
    batches: dict[str, list[tuple[int, int, Ops]]] = field(default_factory=dict)

    def copy(self) -> DiskState:
        return DiskState(
            {g: dict(d) for g, d in self.data.items()},
            dict(self.positions),
            {g: list(b) for g, b in self.batches.items()},
        )


class SimDisk:
    """A node's storage, per queue: its keys, its position, and its batches (identity and
    operations, in order) for the checks. What was written is lost in a crash unless a
    sync made it durable (as a power cut would; a kill -9 loses less)."""

    def __init__(self) -> None:
        self.state = DiskState()
        self.durable = DiskState()
        self.unsynced = False

    @property
    def data(self) -> dict[str, dict[bytes, bytes]]:
        return self.state.data

    @property
    def positions(self) -> dict[str, Position]:
        return self.state.positions

    @property
    def batches(self) -> dict[str, list[tuple[int, int, Ops]]]:
        return self.state.batches

    def write(self, group: str, epoch: int, seq: int, ops: Ops) -> None:
        data = self.data.setdefault(group, {})
        for key, value in ops:
            if value is None:
                data.pop(key, None)
            else:
                data[key] = value
        batches = self.batches.setdefault(group, [])
        assert not batches or batches[-1][1] + 1 == seq, f"batch {seq} after {batches[-1:]}"
        batches.append((epoch, seq, ops))
        self.unsynced = True

    def changed(self) -> None:
        self.unsynced = True

    def sync(self) -> None:
        self.durable = self.state.copy()
        self.unsynced = False

    def crash(self) -> None:
        self.state = self.durable.copy()
        self.unsynced = False

    def held(self, group: str) -> set[BatchId]:
        return {(e, s) for e, s, _ in self.batches.get(group, [])}


class SimStore:
    def __init__(self, node: SimNode) -> None:
        self.node = node

    @property
    def disk(self) -> SimDisk:
        return self.node.disk

    def positions(self) -> dict[str, Position]:
        return dict(self.disk.positions)

    def apply(self, group: str, ops: Ops, position: Position) -> None:
        self.disk.write(group, position.epoch, position.seq, ops)
        self.disk.positions[group] = position
        self.node.pending_applied.append((group, position.seq))

    def record(self, group: str, position: Position) -> None:
        self.disk.positions[group] = position
        self.disk.changed()

    def begin_snapshot(self, group: str) -> None:
        self.disk.data[group] = {}
        self.disk.batches[group] = []
        self.disk.positions[group] = Position(0, (), complete=False)
        self.disk.changed()

    def add_snapshot(self, group: str, ops: Ops) -> None:
        data = self.disk.data.setdefault(group, {})
        for key, value in ops:
            if key == LOG_KEY:
                assert value is not None
                self.disk.batches[group] = _decode_batches(value)
            elif value is not None:
                data[key] = value
        self.disk.changed()

    def end_snapshot(self, group: str, position: Position) -> None:
        self.disk.positions[group] = position
        self.disk.changed()
        self.node.pending_applied.append((group, position.seq))

    def drop(self, group: str) -> None:
        self.disk.data.pop(group, None)
        self.disk.positions.pop(group, None)
        self.disk.batches.pop(group, None)
        self.disk.changed()


def _encode_batches(batches: list[tuple[int, int, Ops]]) -> bytes:
    return json.dumps(
        [
            [e, s, [[k.hex(), None if v is None else v.hex()] for k, v in ops]]
            for e, s, ops in batches
        ]
    ).encode()


def _decode_batches(raw: bytes) -> list[tuple[int, int, Ops]]:
    return [
        (
            int(e),
            int(s),
            tuple((bytes.fromhex(k), None if v is None else bytes.fromhex(v)) for k, v in ops),
        )
        for e, s, ops in json.loads(raw)
    ]


# -- nodes --------------------------------------------------------------------------------------


class SimHost:
    def __init__(self, node: SimNode) -> None:
        self.node = node

    def promote(self, group: str) -> None:
        self.node.cluster.promoted(self.node, group)

    def demote(self, group: str) -> None:
        pass

    def snapshot(self, group: str) -> Iterator[Ops]:
        disk = self.node.disk
        batches = list(disk.batches.get(group, []))
        items = sorted(disk.data.get(group, {}).items())
        yield ((LOG_KEY, _encode_batches(batches)),)
        for start in range(0, len(items), 2):
            yield tuple(items[start : start + 2])


class SimFence:
    def __init__(self, node: SimNode) -> None:
        self.node = node

    @property
    def lease(self) -> int:
        return self.node.lease

    def serving(self) -> bool:
        return self.node.cluster.clock.ms < self.node.valid_until


class SimTransport:
    def __init__(self, node: SimNode) -> None:
        self.node = node

    def send(self, node_id: int, message: Message) -> None:
        self.node.cluster.network.append((self.node.node_id, node_id, message))


class SimCoordinator:
    def __init__(self, node: SimNode) -> None:
        self.node = node

    def propose(self, proposal: Proposal) -> None:
        self.node.cluster.to_etcd.append((self.node.node_id, self.node.incarnation, proposal))


@dataclass
class Acked:
    group: str
    epoch: int
    seq: int
    ops: Ops
    node: int


@dataclass
class Waiting:
    """A client's write, answered once the leader's gate answered it and a sync covered
    it (the committer's future: fsync and gate)."""

    ticket: Ticket
    ops: Ops
    gate: bool = False  # answered without error
    synced: bool = False


class SimNode:
    def __init__(self, cluster: SimCluster, node_id: int) -> None:
        self.cluster = cluster
        self.node_id = node_id
        self.disk = SimDisk()
        self.up = False
        self.paused = False
        self.incarnation = 0
        self.lease = 0
        self.valid_until = 0
        self.replicator: Replicator | None = None
        self.view_revision: dict[Any, int] = {}
        self.watch_at = 0  # index of the next etcd change to deliver
        self.pending_applied: list[tuple[str, int]] = []
        self.waiting: list[Waiting] = []

    def start(self) -> None:
        cluster = self.cluster
        etcd = cluster.etcd
        self.incarnation += 1
        old = etcd.nodes.get(self.node_id)
        if old is not None:
            etcd.revoke(old)  # a restart revokes its predecessor's lease (fila.cluster.lease)
        self.lease = etcd.grant()
        etcd.join(self.node_id, self.lease)
        self.valid_until = cluster.clock.ms + TTL_MS
        self.up = True
        self.paused = False
        self.pending_applied = []
        self.waiting = []
        self.replicator = Replicator(
            self.node_id,
            cluster.settings,
            cluster.clock,
            SimFence(self),
            SimCoordinator(self),
            SimTransport(self),
            SimStore(self),
            SimHost(self),
            cluster.new_id,
        )
        # The node's view of etcd: a snapshot, then the watch from its revision.
        self.view_revision = {}
        for node_id, lease in etcd.nodes.items():
            self.replicator.node_changed(node_id, lease)
        for group, record in etcd.queues.items():
            self.replicator.record_changed(group, record)
        self.watch_at = len(etcd.changes)
        self.replicator.start()

    @property
    def active(self) -> bool:
        return self.up and not self.paused

    def see(self, change: Change) -> None:
        """Applies an etcd change to this node's view, unless a newer one is known."""
        key = (change.kind, change.name)
        if change.revision <= self.view_revision.get(key, 0):
            return
        self.view_revision[key] = change.revision
        assert self.replicator is not None
        if change.kind == "node":
            self.replicator.node_changed(change.name, change.value)
        else:
            self.replicator.record_changed(change.name, change.value)

    def renew(self) -> None:
        """The lease renewal (fila.cluster.lease), or a new lease if etcd expired it."""
        cluster = self.cluster
        if not self.active or self.node_id in cluster.cut_from_etcd:
            return
        etcd = cluster.etcd
        if etcd.renew(self.lease):
            self.valid_until = cluster.clock.ms + TTL_MS
            return
        self.lease = etcd.grant()
        etcd.join(self.node_id, self.lease)
        self.valid_until = cluster.clock.ms + TTL_MS
        assert self.replicator is not None
        self.replicator.lease_changed()

    def sync(self) -> None:
        """An fsync: everything written is durable; the answers that waited for it go."""
        self.disk.sync()
        applied, self.pending_applied = self.pending_applied, []
        for waiting in self.waiting:
            waiting.synced = True
        self.cluster.release(self)
        assert self.replicator is not None
        for group, seq in applied:
            self.replicator.applied(group, seq)


# -- the cluster --------------------------------------------------------------------------------


class SimCluster:
    def __init__(
        self, nodes: int = 3, groups: tuple[str, ...] = ("a", "b"), replicas: int = 0
    ) -> None:
        """`replicas`: how many nodes hold each group (0: all), nodes 1 to `replicas`."""
        self.clock = SimClock()
        self.etcd = SimEtcd(self.clock)
        self.settings = Settings(lag_ms=TTL_MS, heartbeat_ms=500, resubscribe_ms=2000, window=8)
        self._ids = itertools.count(1)
        self.nodes = {n: SimNode(self, n) for n in range(1, nodes + 1)}
        self.network: list[tuple[int, int, Message]] = []
        self.to_etcd: list[tuple[int, int, Proposal]] = []
        self.from_etcd: list[tuple[int, int, str, Outcome, int]] = []
        self.cut: set[frozenset[int]] = set()
        self.cut_from_etcd: set[int] = set()
        self.wiped: dict[int, set[str]] = {}  # node -> groups whose disk copy was lost
        self.acked: list[Acked] = []
        self.leaders: dict[tuple[str, int], int] = {}
        self.groups = groups
        self._keys = itertools.count(1)
        self._turn = 0
        for node in self.nodes.values():
            node.start()
        first = self.nodes[1]
        for group in groups:
            record = Placement(
                1,
                f"claim-{group}",
                0,
                replicas=tuple(self.nodes)[: replicas or nodes],
                isr=(1,),
                epoch=1,
                leader_lease=first.lease,
            )
            self.etcd.put_queue(group, record)
        self.settle()
        for group in groups:  # answered batches from the start: every loss shows
            for settle in (False, False, False, True):
                self.write(1, group, settle=settle)
        self.settle(rounds=5)
        assert len(self.acked) == 4 * len(groups), self.acked

    def new_id(self) -> int:
        return next(self._ids)

    # -- what the protocol tells the world ---------------------------------------------------

    def promoted(self, node: SimNode, group: str) -> None:
        assert node.replicator is not None
        record = node.replicator.record(group)
        assert record is not None
        key = (group, record.epoch)
        assert self.leaders.setdefault(key, node.node_id) == node.node_id, (
            f"two leaders for {key}: {self.leaders[key]} and {node.node_id}"
        )

    def leader(self, group: str) -> int:
        return self.etcd.queues[group].node_id

    # -- clients ----------------------------------------------------------------------------------

    def write(self, node_id: int, group: str, *, settle: bool, client: bool = True) -> bool:
        """A client's write to `group` through its leader `node_id` (refused unless it
        serves), or with `client` False a write the leader's own timers make (a lease
        expiring) whether or not it serves. Returns whether a batch was written."""
        node = self.nodes[node_id]
        replicator = node.replicator
        if not node.active or replicator is None or not replicator.leads(group):
            return False
        if client and not replicator.serving(group):
            return False
        data = node.disk.data.get(group, {})
        if settle and data:
            ops: Ops = ((min(data), None),)
        else:
            ops = ((f"k{next(self._keys)}".encode(), b"v"),)
        ticket = replicator.written(group, ops)
        assert ticket is not None
        node.disk.write(group, ticket.epoch, ticket.seq, ops)
        position = replicator.position(group)
        assert position is not None
        node.disk.positions[group] = position
        node.pending_applied.append((group, ticket.seq))
        if client:
            waiting = Waiting(ticket, ops)
            node.waiting.append(waiting)
            ticket.when_answered(lambda error: self._gate(node, waiting, error))
        return True

    def _gate(self, node: SimNode, waiting: Waiting, error: BrokerError | None) -> None:
        if error is not None:
            node.waiting.remove(waiting)
            return
        assert node.replicator is not None and node.replicator.serving(waiting.ticket.group), (
            f"node {node.node_id} answered a write while it may not serve"
        )
        waiting.gate = True
        self.release(node)

    def release(self, node: SimNode) -> None:
        """Answers the clients whose writes are both synced and through the gate."""
        for waiting in [w for w in node.waiting if w.gate and w.synced]:
            node.waiting.remove(waiting)
            ticket = waiting.ticket
            self.acked.append(
                Acked(ticket.group, ticket.epoch, ticket.seq, waiting.ops, node.node_id)
            )

    # -- what happens next: one event at a time ------------------------------------------------

    def events(self) -> list[tuple[str, int]]:
        """Everything that could happen now: a message or etcd answer delivered, a watch
        event seen, a sync. Paused nodes take part in nothing."""
        nodes = self.nodes
        found: list[tuple[str, int]] = []
        found += [("deliver", i) for i, m in enumerate(self.network) if not nodes[m[1]].paused]
        found += [("request", i) for i, _ in enumerate(self.to_etcd)]
        found += [("answer", i) for i, a in enumerate(self.from_etcd) if not nodes[a[0]].paused]
        for node_id, node in nodes.items():
            if not node.active:
                continue
            if node.watch_at < len(self.etcd.changes) and node_id not in self.cut_from_etcd:
                found.append(("watch", node_id))
            if node.disk.unsynced or node.pending_applied:
                found.append(("sync", node_id))
        return found

    def step(self, index: int) -> bool:
        """Makes one of `events()` happen (any of them: delivery in any order)."""
        events = self.events()
        if not events:
            return False
        kind, at = events[index % len(events)]
        if kind == "deliver":
            self._deliver(at)
        elif kind == "request":
            self._request(at)
        elif kind == "answer":
            self._answer(at)
        elif kind == "watch":
            node = self.nodes[at]
            change = self.etcd.changes[node.watch_at]
            node.watch_at += 1
            node.see(change)
        else:
            self.nodes[at].sync()
        return True

    def _deliver(self, index: int) -> None:
        source, target, message = self.network.pop(index)
        node = self.nodes[target]
        if not node.up or frozenset((source, target)) in self.cut:
            return
        replicator = node.replicator
        assert replicator is not None
        group = message.group
        known = replicator._epochs.get(group, 0)
        before = node.disk.batches.get(group, [])[-1:], node.disk.positions.get(group)
        replicator.received(source, message)
        if message.epoch < known and not isinstance(message, (Subscribe, Ack)):
            after = node.disk.batches.get(group, [])[-1:], node.disk.positions.get(group)
            assert before == after, (
                f"node {target} applied {type(message).__name__} of epoch {message.epoch} "
                f"after it knew epoch {known}"
            )

    def _request(self, index: int) -> None:
        node_id, incarnation, proposal = self.to_etcd.pop(index)
        if node_id in self.cut_from_etcd:
            self._unknown(node_id, incarnation, proposal.group, proposal.token)
            return
        ok, record, revision = self.etcd.transact(proposal)
        outcome = Outcome(proposal.token, ok, record)
        self.from_etcd.append((node_id, incarnation, proposal.group, outcome, revision))

    def _answer(self, index: int) -> None:
        node_id, incarnation, group, outcome, revision = self.from_etcd.pop(index)
        node = self.nodes[node_id]
        if not node.up or node.incarnation != incarnation:
            return
        if node_id in self.cut_from_etcd:
            self._unknown(node_id, incarnation, group, outcome.token)
            return
        assert node.replicator is not None
        node.see(Change(revision, "queue", group, outcome.record))
        node.replicator.decided(group, outcome)

    def _unknown(self, node_id: int, incarnation: int, group: str, token: int) -> None:
        """A request or its answer was lost: the node's call times out."""
        node = self.nodes[node_id]
        if node.up and node.incarnation == incarnation and node.replicator is not None:
            node.replicator.decided(group, Outcome(token, False, None, known=False))

    def lose(self, index: int) -> None:
        if self.network:
            self.network.pop(index % len(self.network))

    def advance(self, ms: int) -> None:
        """Time passes: leases renewed or expired, every running node ticks."""
        step = 100
        while ms > 0:
            taken = min(step, ms)
            ms -= taken
            self.clock.ms += taken
            for node in self.nodes.values():
                node.renew()
            self.etcd.expire()
            for node in self.nodes.values():
                if node.active and node.replicator is not None:
                    node.replicator.tick()

    # -- faults -------------------------------------------------------------------------------

    def kill(self, node_id: int) -> None:
        node = self.nodes[node_id]
        if not node.up:
            return
        node.up = False
        node.paused = False
        node.replicator = None
        node.pending_applied = []
        node.waiting = []
        node.disk.crash()
        self.network = [m for m in self.network if m[1] != node_id]

    def restart(self, node_id: int) -> None:
        node = self.nodes[node_id]
        if not node.up:
            node.start()

    def wipe(self, node_id: int) -> None:
        self.kill(node_id)
        self.nodes[node_id].disk = SimDisk()
        self.wiped[node_id] = set(self.groups)

    def remove_node(self, node_id: int) -> bool:
        """`fila cluster remove-node` (fila.cluster.replication.removal): refused while
        the node's membership key lives or where it holds the only in-sync copy; else
        each queue with a replica there has it replaced by the live node holding the
        fewest replicas (none left: the set shrinks) and leaves its ISR, in one change
        per queue. The real call compares each record it replaces; here it is applied
        at one instant, so any proposal made on the old record fails as it would."""
        if node_id in self.etcd.nodes or any(
            lost_with(self.current(group), node_id) for group in self.groups
        ):
            return False
        for group in self.groups:
            record = self.current(group)
            if node_id not in record.replicas:
                continue
            load = {n: sum(n in self.current(g).replicas for g in self.groups) for n in self.nodes}
            spare = sorted((load[n], n) for n in self.etcd.nodes if n not in record.replicas)
            replicas = tuple(n for n in record.replicas if n != node_id) + tuple(
                n for _, n in spare[:1]
            )
            isr = tuple(n for n in record.isr if n != node_id)
            moved = replace(record, replicas=replicas, isr=isr, version=record.version + 1, raw=b"")
            self.etcd.put_queue(group, moved)
        return True

    def delete_queue(self, group: str) -> None:
        """`DeleteQueue`: the record goes from etcd; the checks leave the group out."""
        self.etcd.delete_queue(group)
        self.groups = tuple(g for g in self.groups if g != group)

    def pause(self, node_id: int) -> None:
        if self.nodes[node_id].up:
            self.nodes[node_id].paused = True

    def resume(self, node_id: int) -> None:
        """The node runs again; what it does first (read what waited for it, renew its
        lease, tick) is up to the steps that follow."""
        node = self.nodes[node_id]
        if node.up and node.paused:
            node.paused = False

    def isolate(self, node_id: int) -> None:
        """Cuts `node_id` from every other node (not from etcd)."""
        for other in self.nodes:
            if other != node_id:
                self.cut.add(frozenset((node_id, other)))

    def heal(self) -> None:
        self.cut.clear()
        self.cut_from_etcd.clear()
        for node_id, node in self.nodes.items():
            if node.paused:
                self.resume(node_id)
            if not node.up:
                self.restart(node_id)

    # -- running to quiet ----------------------------------------------------------------------

    def run(
        self,
        count: int,
        *,
        check: bool = False,
        hold: Callable[[tuple[str, int]], bool] | None = None,
    ) -> int:
        """Lets up to `count` pending events happen in a fair order: each kind of event
        in turn, the oldest of that kind first (so messages arrive in order), except
        those `hold` keeps back. Returns how many happened; with `check`, the invariants
        are checked after each."""
        done = 0
        for _ in range(count):
            events = self.events()
            allowed = [i for i, event in enumerate(events) if hold is None or not hold(event)]
            if not allowed:
                break
            kinds = sorted({events[i][0] for i in allowed})
            self._turn += 1
            kind = kinds[self._turn % len(kinds)]
            self.step(next(i for i in allowed if events[i][0] == kind))
            done += 1
            if check:
                self.check()
        return done

    def settle(
        self,
        rounds: int = 50,
        *,
        check: bool = False,
        hold: Callable[[tuple[str, int]], bool] | None = None,
    ) -> None:
        """Lets everything pending happen, in order, with time passing in between:
        what a cluster does on its own (but for what `hold` keeps back)."""
        for _ in range(rounds):
            self.run(10_000, check=check, hold=hold)
            self.advance(100)
            if check:
                self.check()

    # -- invariants -------------------------------------------------------------------------------

    def current(self, group: str) -> Placement:
        return self.etcd.queues[group]

    def intact(self, node_id: int, group: str) -> bool:
        """Whether `node_id` still has its disk copy of `group` (not wiped since)."""
        return group not in self.wiped.get(node_id, set())

    def check(self) -> None:
        """The safety invariants, true after every step."""
        for group in self.groups:
            record = self.current(group)
            acked = [a for a in self.acked if a.group == group]
            for member in record.isr:
                node = self.nodes[member]
                if not self.intact(member, group) and not self._leads(member, group):
                    continue  # a lost copy is forgiven, not in a leader
                for state, what in ((node.disk.state, "holds"), (node.disk.durable, "synced")):
                    held = {(e, s) for e, s, _ in state.batches.get(group, [])}
                    missing = [(a.epoch, a.seq) for a in acked if (a.epoch, a.seq) not in held]
                    assert not missing, (
                        f"in-sync node {member} of {group} {what} no acknowledged batches "
                        f"{missing[:5]} (record {replace(record, raw=b'')})"
                    )
            for node in self.nodes.values():
                self._check_disk(node, group)
        for node_id, groups in self.wiped.items():
            for group in list(groups):
                # Out of the ISR, a replica comes back only when a leader finds it caught
                # up, but an addition proposed before the wipe can still land while the
                # node is down (its old lease lives on until it restarts; its leader
                # takes it out once it runs). So the copy counts as intact
                # again only once the node runs again, out of the ISR.
                if self.nodes[node_id].up and node_id not in self.current(group).isr:
                    groups.discard(group)

    def _leads(self, node_id: int, group: str) -> bool:
        replicator = self.nodes[node_id].replicator
        return replicator is not None and replicator.leads(group)

    def _check_disk(self, node: SimNode, group: str) -> None:
        """A replica's keys are exactly what its batches make."""
        position = node.disk.positions.get(group)
        if position is None or not position.complete:
            return
        data: dict[bytes, bytes] = {}
        for _, _, ops in node.disk.batches.get(group, []):
            for key, value in ops:
                if value is None:
                    data.pop(key, None)
                else:
                    data[key] = value
        assert data == node.disk.data.get(group, {}), f"node {node.node_id} {group}: keys differ"
