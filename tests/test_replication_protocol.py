"""The replication protocol (`fila.cluster.replication.replicator`) under an adversary:
Hypothesis drives a three-node in-memory cluster (tests/support/replication_sim.py)
through writes, message delivery in any order, lost messages and etcd answers, time,
kills, restarts, pauses, wiped disks, cut links and a node's removal, and checks after
every step:

- every acknowledged batch is on every in-sync replica (that still has its disk), so
  no acknowledged write, enqueue or settlement, is lost while one of them survives;
- a replica's keys are exactly what its batches make (snapshots included);
- epochs only grow in etcd, and no two nodes lead one epoch of a queue.

At the end, with every node up and every link whole, the cluster must heal: each
queue led, every replica in sync, holding the same batches as the leader (no
divergent suffix left anywhere), unless every in-sync replica lost its disk.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.replication_sim import TTL_MS, SimCluster

NODES = st.sampled_from([1, 2, 3])
GROUPS = st.sampled_from(["a", "b"])
ANY = st.integers(min_value=0, max_value=10_000)


def removed(cluster: SimCluster, node_id: int) -> bool:
    """`node_id` dies, its lease runs out, and `remove-node` is called for it."""
    cluster.kill(node_id)
    cluster.advance(TTL_MS + 100)
    return cluster.remove_node(node_id)


class Replication(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cluster = SimCluster()
        self.removed = False

    # -- clients and the leader's own writes ---------------------------------------------

    @rule(group=GROUPS, settle=st.booleans(), count=st.integers(min_value=1, max_value=4))
    def client_write(self, group: str, settle: bool, count: int) -> None:
        """Through the leader etcd names (refused if it does not serve)."""
        for _ in range(count):
            self.cluster.write(self.cluster.leader(group), group, settle=settle)

    @rule(node=NODES, group=GROUPS, settle=st.booleans())
    def client_write_anywhere(self, node: int, group: str, settle: bool) -> None:
        """Through any node that thinks it leads (a deposed one must refuse)."""
        self.cluster.write(node, group, settle=settle)

    @rule(node=NODES, group=GROUPS)
    def timer_write(self, node: int, group: str) -> None:
        """A write a node that thinks it leads makes on its own (a lease expiring),
        fenced or not."""
        self.cluster.write(node, group, settle=False, client=False)

    # -- what happens next ------------------------------------------------------------------

    @rule(index=ANY)
    def step(self, index: int) -> None:
        self.cluster.step(index)

    @rule(index=ANY, count=st.integers(min_value=2, max_value=12))
    def steps(self, index: int, count: int) -> None:
        for offset in range(count):
            self.cluster.step(index + offset)

    @rule(count=st.integers(min_value=5, max_value=100))
    def run(self, count: int) -> None:
        """The network and etcd work for a while (in order)."""
        self.cluster.run(count)

    @rule(count=st.integers(min_value=5, max_value=100))
    def run_more(self, count: int) -> None:
        self.cluster.run(count)

    @rule(index=ANY)
    def lose(self, index: int) -> None:
        self.cluster.lose(index)

    @rule(ms=st.sampled_from([100, 300, 1000, TTL_MS + 500]))
    def time_passes(self, ms: int) -> None:
        self.cluster.advance(ms)

    # -- faults ------------------------------------------------------------------------------

    @rule(group=GROUPS)
    def kill_leader(self, group: str) -> None:
        self.cluster.kill(self.cluster.leader(group))

    @rule(node=NODES)
    def kill(self, node: int) -> None:
        self.cluster.kill(node)

    @rule(node=NODES)
    def restart(self, node: int) -> None:
        self.cluster.restart(node)

    @rule(group=GROUPS)
    def pause_leader(self, group: str) -> None:
        self.cluster.pause(self.cluster.leader(group))

    @rule(node=NODES)
    def pause(self, node: int) -> None:
        self.cluster.pause(node)

    @rule(node=NODES)
    def resume(self, node: int) -> None:
        self.cluster.resume(node)

    @precondition(lambda self: len(self.cluster.wiped) < 2)
    @rule(node=NODES)
    def wipe(self, node: int) -> None:
        self.cluster.wipe(node)

    @precondition(lambda self: not self.removed)
    @rule(node=NODES)
    def remove_node(self, node: int) -> None:
        """The node dies, its lease runs out, and `fila cluster remove-node` takes it
        (refused where it holds the only in-sync copy): with no spare node here, its
        queues' replica sets shrink to two. It may still come back later."""
        self.removed = removed(self.cluster, node)

    @rule(group=GROUPS)
    def isolate_leader(self, group: str) -> None:
        self.cluster.isolate(self.cluster.leader(group))

    @rule(a=NODES, b=NODES)
    def cut_link(self, a: int, b: int) -> None:
        if a != b:
            self.cluster.cut.add(frozenset((a, b)))

    @rule(node=NODES)
    def cut_from_etcd(self, node: int) -> None:
        self.cluster.cut_from_etcd.add(node)

    @rule()
    def heal_links(self) -> None:
        self.cluster.cut.clear()
        self.cluster.cut_from_etcd.clear()

    @rule()
    def heal_all(self) -> None:
        self.cluster.heal()

    # -- the invariants ------------------------------------------------------------------------

    @invariant()
    def safe(self) -> None:
        self.cluster.check()

    def teardown(self) -> None:
        cluster = self.cluster
        cluster.heal()
        cluster.settle(rounds=120)
        cluster.check()
        for group in cluster.groups:
            record = cluster.current(group)
            if not any(cluster.intact(m, group) for m in record.isr):
                continue  # every in-sync replica lost its disk: it waits (no unclean election)
            leader = cluster.nodes[record.node_id]
            assert leader.replicator is not None and leader.replicator.serving(group), (
                f"{group} is not served after healing: {record}"
            )
            assert set(record.isr) == set(record.replicas), f"{group} did not heal: {record}"
            batches = leader.disk.batches.get(group, [])
            for member in record.replicas:
                node = cluster.nodes[member]
                position = node.disk.positions.get(group)
                assert position is not None and position.whole, f"node {member}: {position}"
                assert node.disk.batches.get(group, []) == batches, (
                    f"node {member} of {group} differs from leader {record.node_id}"
                )
                assert node.disk.data.get(group, {}) == leader.disk.data.get(group, {})


# FILA_REPLICATION_EXAMPLES=5000 for a longer search than the default run makes.
Replication.TestCase.settings = settings(
    max_examples=int(os.environ.get("FILA_REPLICATION_EXAMPLES", "150")),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestReplicationProtocol = Replication.TestCase


ROUNDS = TTL_MS // 100 + 10  # long enough for a lease to run out and an election


def test_a_healthy_cluster_answers_writes_once_every_replica_holds_them() -> None:
    cluster = SimCluster()
    assert all(set(cluster.current(g).isr) == {1, 2, 3} for g in cluster.groups)
    answered = len(cluster.acked)
    assert cluster.write(1, "a", settle=False)
    cluster.run(10_000, hold=lambda event: event == ("sync", 3))
    assert len(cluster.acked) == answered  # node 3 has not acknowledged yet
    cluster.settle(rounds=2, check=True)
    assert len(cluster.acked) == answered + 1


def test_a_dead_leaders_queue_moves_to_an_in_sync_follower_with_every_answered_batch() -> None:
    cluster = SimCluster()
    cluster.kill(1)
    cluster.settle(rounds=ROUNDS, check=True)
    record = cluster.current("a")
    assert record.node_id in (2, 3) and record.epoch == 2 and 1 not in record.isr
    answered = len(cluster.acked)
    assert cluster.write(record.node_id, "a", settle=True)
    cluster.settle(rounds=3, check=True)  # at once: the dead leader is not waited for
    assert len(cluster.acked) == answered + 1


def test_with_no_in_sync_replica_alive_no_other_replica_takes_over() -> None:
    cluster = SimCluster()
    cluster.isolate(1)
    cluster.write(1, "a", settle=False)
    cluster.settle(rounds=ROUNDS, check=True)  # the followers leave the ISR
    assert cluster.current("a").isr == (1,)
    assert cluster.acked[-1].seq == 5
    cluster.kill(1)
    cluster.settle(rounds=ROUNDS, check=True)
    record = cluster.current("a")
    assert record.node_id == 1 and record.epoch == 1  # nobody took over: it waits for node 1
    cluster.restart(1)
    cluster.cut.clear()
    cluster.settle(rounds=ROUNDS, check=True)
    assert cluster.current("a").epoch == 2 and cluster.current("a").node_id == 1


def test_a_leader_alone_in_its_isr_acknowledges_nothing_once_its_lease_ran_out() -> None:
    """SPEC 9 "Fencing" where the fence alone stops a leader: with no follower in sync
    there is nobody to refuse its batches, so once cut off from etcd past its lease it
    must refuse writes itself (and its timers' writes must not be acknowledged)."""
    cluster = SimCluster()
    cluster.isolate(1)
    cluster.write(1, "a", settle=False)
    cluster.settle(rounds=ROUNDS, check=True)  # the followers leave the ISR
    assert cluster.current("a").isr == (1,)
    assert cluster.write(1, "a", settle=False)  # answered alone
    cluster.settle(rounds=2, check=True)
    answered = len(cluster.acked)
    cluster.cut_from_etcd.add(1)
    cluster.settle(rounds=ROUNDS, check=True)  # its lease runs out; it renews nothing
    replicator = cluster.nodes[1].replicator
    assert replicator is not None and replicator.leads("a")
    assert not replicator.serving("a")
    assert not cluster.write(1, "a", settle=False)
    cluster.write(1, "a", settle=False, client=False)
    cluster.settle(rounds=3, check=True)
    assert len(cluster.acked) == answered
    cluster.cut_from_etcd.clear()
    cluster.settle(rounds=ROUNDS, check=True)  # a new lease: it serves its queue again
    assert cluster.write(1, "a", settle=False)
    cluster.settle(rounds=2, check=True)
    assert len(cluster.acked) == answered + 1


def test_writes_pending_when_their_queue_is_deleted_are_answered_with_an_error() -> None:
    """The leader stops leading a deleted queue: what waited for a follower must not
    be answered as written (and every node drops its copy)."""
    cluster = SimCluster()
    cluster.cut.add(frozenset((1, 2)))  # node 2 does not acknowledge: the batch waits
    answered = len(cluster.acked)
    assert cluster.write(1, "a", settle=False)
    cluster.run(10_000, check=True)
    leader = cluster.nodes[1].replicator
    assert leader is not None and leader.serving("a") and cluster.nodes[1].waiting
    cluster.delete_queue("a")
    cluster.settle(rounds=3, check=True)
    assert len(cluster.acked) == answered and not cluster.nodes[1].waiting
    for node in cluster.nodes.values():
        assert node.replicator is not None and not node.replicator.leads("a")
        assert "a" not in node.disk.positions and not node.disk.data.get("a")


def test_a_paused_leader_answers_nothing_once_resumed_and_no_follower_keeps_its_batches() -> None:
    cluster = SimCluster()
    cluster.write(1, "a", settle=False)  # on its way, not answered
    cluster.pause(1)
    cluster.settle(rounds=2 * TTL_MS // 100, check=True)  # node 2 or 3 takes over
    assert cluster.current("a").node_id != 1
    answered = len(cluster.acked)
    cluster.resume(1)
    # First what waited for it: the followers' acknowledgements of its last batch.
    assert cluster.run(10_000, check=True, hold=lambda event: event[0] != "deliver")
    cluster.write(1, "a", settle=False, client=False)  # its timers still write
    cluster.settle(rounds=ROUNDS, check=True)
    assert all(a.node != 1 for a in cluster.acked[answered:])
    leader = cluster.nodes[cluster.current("a").node_id]
    assert cluster.nodes[1].disk.batches["a"] == leader.disk.batches["a"]  # rebuilt


def test_an_isr_add_applied_after_the_replica_lost_its_disk_loses_nothing() -> None:
    """Found by Hypothesis: the leader proposes a caught-up replica back into the ISR,
    the replica loses its disk (and is down) before etcd applies the proposal, so etcd
    counts an empty replica in sync. Once it runs again its leader takes it out (its
    session is new and untrusted) and it counts again only once caught up: nothing
    acknowledged is lost, and it heals."""
    state = Replication()
    state.wipe(node=1)
    state.heal_all()
    state.run(count=40)  # node 1 caught up; the leader's add of it is on its way
    state.wipe(node=1)
    state.run(count=8)
    assert 1 in state.cluster.current("a").isr  # applied late: the case itself
    state.safe()
    state.teardown()


def test_an_isr_add_is_refused_when_the_replica_restarted_since_it_caught_up() -> None:
    """Found by Hypothesis (Kafka's KIP-903 case): a replica caught up, lost its disk
    and started again, empty, before its leader heard of the restart (the membership
    watch lags). The leader's session with the old incarnation says caught up, so it
    proposes the replica into the ISR; the transaction requires the replica's
    membership key to be on the lease of the incarnation that caught up, and fails.
    Without that, the empty replica counted in sync and could lead once it held a
    prefix of the log, losing what the others acknowledged."""
    state = Replication()
    cluster = state.cluster
    state.kill(node=1)
    state.client_write(count=1, group="a", settle=False)
    state.wipe(node=1)
    state.heal_all()
    state.run(count=45)  # node 1 caught up, not yet back in the ISR
    assert cluster.current("a").isr == (2, 3)
    state.wipe(node=1)
    state.wipe(node=3)
    state.heal_all()

    def adding_1() -> bool:
        return any(p.group == "a" and 1 in p.record.isr for _, _, p in cluster.to_etcd)

    for _ in range(20):
        if adding_1():
            break
        cluster.run(1, check=True)
    assert adding_1()  # proposed from the old incarnation's session
    while adding_1():
        cluster.run(1, check=True)
    assert 1 not in cluster.current("a").isr  # and refused
    state.teardown()


def _proposing(cluster: SimCluster, node: int, group: str) -> bool:
    return any(n == node and p.group == group for n, _, p in cluster.to_etcd)


def test_a_replica_being_added_to_the_isr_is_waited_for_from_the_proposal_on() -> None:
    cluster = SimCluster()
    cluster.isolate(3)
    cluster.write(1, "a", settle=False)
    cluster.settle(rounds=ROUNDS, check=True)
    assert cluster.current("a").isr == (1, 2)
    cluster.cut.clear()
    for _ in range(ROUNDS):  # node 3 catches up; the leader proposes it, etcd waits
        cluster.settle(rounds=1, check=True, hold=lambda event: event[0] == "request")
        if _proposing(cluster, 1, "a"):
            break
    assert _proposing(cluster, 1, "a")
    answered = len(cluster.acked)
    cluster.isolate(3)
    cluster.write(1, "a", settle=False)  # node 3 will not get it
    cluster.run(10_000, check=True, hold=lambda event: event[0] == "request")
    assert len(cluster.acked) == answered  # not answered without node 3
    cluster.run(10_000, check=True)  # etcd adds node 3 to the ISR
    assert 3 in cluster.current("a").isr
    cluster.cut.clear()
    cluster.settle(rounds=ROUNDS, check=True)
    assert len(cluster.acked) == answered + 1


def test_a_member_that_needs_a_snapshot_leaves_the_isr_before_it_gets_one() -> None:
    cluster = SimCluster()
    cluster.cut.add(frozenset((1, 2)))
    cluster.write(1, "a", settle=False)  # node 2 does not get it: not answered yet
    cluster.settle(rounds=3, check=True)
    leader, follower = cluster.nodes[1].replicator, cluster.nodes[2].replicator
    assert leader is not None and follower is not None
    leader._logs["a"].clear()  # the log no longer reaches back
    cluster.cut.clear()
    follower._resubscribe("a")  # a new session, from where its disk stands
    assert 2 in cluster.current("a").isr
    before = len(cluster.etcd.history)
    cluster.settle(rounds=ROUNDS, check=True)
    isr_seen = [record.isr for group, record in cluster.etcd.history[before:] if group == "a"]
    assert isr_seen == [(1, 3), (1, 2, 3)]
    assert cluster.nodes[2].disk.data["a"] == cluster.nodes[1].disk.data["a"]


def test_a_follower_counts_as_holding_only_what_is_on_its_disk() -> None:
    cluster = SimCluster()
    answered = len(cluster.acked)
    cluster.write(1, "a", settle=False)
    cluster.run(10_000, hold=lambda event: event == ("sync", 2))  # applied, not synced
    assert cluster.nodes[2].disk.unsynced and len(cluster.acked) == answered
    follower = cluster.nodes[2].replicator
    assert follower is not None
    follower._resubscribe("a")  # a new session (say, after a lost message)
    cluster.run(10_000, check=True, hold=lambda event: event == ("sync", 2))
    assert len(cluster.acked) == answered  # the subscription's position is not an ack
    cluster.kill(2)  # loses what was not synced
    cluster.settle(rounds=ROUNDS, check=True)
    assert len(cluster.acked) == answered + 1


def test_a_replica_with_a_divergent_suffix_is_rebuilt_from_the_new_leader() -> None:
    cluster = SimCluster()
    cluster.write(1, "a", settle=False)
    to_two = [i for i, (s, t, _) in enumerate(cluster.network) if (s, t) == (1, 2)]
    cluster.lose(to_two[-1])  # node 2 never gets the batch; node 3 does
    cluster.run(
        10_000, hold=lambda event: event[0] == "deliver" and cluster.network[event[1]][1] == 1
    )
    cluster.kill(1)
    cluster.cut_from_etcd.add(3)  # node 2 wins the election
    cluster.settle(rounds=ROUNDS, check=True)
    assert cluster.current("a").node_id == 2
    cluster.write(2, "a", settle=False)  # the same sequence number, another batch
    seq = cluster.nodes[2].disk.batches["a"][-1][1]
    assert cluster.nodes[3].disk.batches["a"][seq - 1][0] == 1  # node 3 diverges
    cluster.cut_from_etcd.clear()
    cluster.restart(1)
    cluster.settle(rounds=ROUNDS, check=True)
    for node in (1, 3):
        assert cluster.nodes[node].disk.batches["a"] == cluster.nodes[2].disk.batches["a"]


def test_a_wiped_node_counted_in_sync_may_not_lead_until_it_caught_up_again() -> None:
    cluster = SimCluster()
    cluster.wipe(2)
    cluster.restart(2)  # etcd still counts node 2 in sync
    cluster.kill(1)
    cluster.cut_from_etcd.add(3)  # node 3 cannot take over for now
    cluster.settle(rounds=ROUNDS, check=True)
    assert cluster.current("a").node_id == 1  # node 2, which holds nothing, did not
    cluster.cut_from_etcd.clear()
    cluster.settle(rounds=ROUNDS, check=True)
    record = cluster.current("a")
    assert record.node_id == 3
    cluster.restart(1)
    cluster.settle(rounds=ROUNDS, check=True)
    assert set(cluster.current("a").isr) == {1, 2, 3}
    assert cluster.nodes[2].disk.batches["a"] == cluster.nodes[3].disk.batches["a"]
    assert cluster.nodes[2].disk.positions["a"].whole  # it was taken out, and earned it back


def test_a_wiped_follower_comes_back_from_a_snapshot() -> None:
    cluster = SimCluster()
    leader = cluster.nodes[1].replicator
    assert leader is not None
    leader._logs["a"].clear()  # the log no longer reaches back
    cluster.wipe(2)
    cluster.restart(2)
    cluster.settle(rounds=ROUNDS, check=True)
    assert cluster.nodes[2].disk.data["a"] == cluster.nodes[1].disk.data["a"]
    assert set(cluster.current("a").isr) == {1, 2, 3}
    assert cluster.nodes[2].disk.positions["a"].whole  # it was taken out, and earned it back


def test_a_snapshot_cut_short_is_sent_again_whole() -> None:
    cluster = SimCluster()
    cluster.isolate(2)
    for _ in range(3):
        cluster.write(1, "a", settle=False)
    cluster.settle(rounds=ROUNDS, check=True)  # node 2 leaves the ISR
    leader = cluster.nodes[1].replicator
    assert leader is not None
    leader._logs["a"].clear()  # node 2 will need a snapshot
    cluster.cut.clear()
    for _ in range(ROUNDS):  # until the first chunk is on node 2's disk
        cluster.run(1)
        position = cluster.nodes[2].disk.positions.get("a")
        if position is not None and not position.complete and cluster.nodes[2].disk.data["a"]:
            break
        if not cluster.events():
            cluster.advance(100)
    cluster.nodes[2].sync()
    cluster.kill(2)  # the snapshot is cut short, on disk
    assert not cluster.nodes[2].disk.positions["a"].complete
    cluster.kill(1)  # node 3 takes over: its log reaches back to the first batch
    cluster.settle(rounds=ROUNDS, check=True)
    assert cluster.current("a").node_id == 3
    cluster.restart(2)  # a partial replica: only a snapshot completes it
    cluster.restart(1)
    cluster.settle(rounds=ROUNDS, check=True)
    assert cluster.nodes[2].disk.positions["a"].whole
    assert cluster.nodes[2].disk.batches["a"] == cluster.nodes[3].disk.batches["a"]
    assert set(cluster.current("a").isr) == {1, 2, 3}


def test_a_wiped_follower_leaves_the_isr_once_even_if_the_log_brings_it_back_at_once() -> None:
    cluster = SimCluster()
    cluster.wipe(2)
    cluster.restart(2)  # etcd still counts it in sync; the leader's log reaches back
    before = len(cluster.etcd.history)
    cluster.settle(rounds=ROUNDS, check=True)
    isr_seen = [record.isr for group, record in cluster.etcd.history[before:] if group == "a"]
    assert isr_seen == [(1, 3), (1, 2, 3)]
    assert cluster.nodes[2].disk.positions["a"].whole


def test_a_wiped_node_that_caught_up_part_of_the_log_may_not_lead_while_counted_in_sync() -> None:
    """A replica rebuilt after its disk was lost, while etcd still counts it in sync, is
    not eligible to lead (Position.eligible) until a leader has taken it out of the ISR,
    even once the log has given it some batches back: otherwise, with the leader gone
    before it took the replica out, it would lead with only part of what was answered."""
    cluster = SimCluster()
    cluster.kill(3)
    cluster.settle(rounds=ROUNDS, check=True)
    assert cluster.current("a").isr == (1, 2)
    for _ in range(4):
        assert cluster.write(1, "a", settle=False)
    cluster.settle(rounds=3, check=True)
    answered = len(cluster.nodes[1].disk.batches["a"])
    cluster.cut_from_etcd.add(1)  # node 1 cannot take node 2 out of the ISR now
    cluster.wipe(2)
    cluster.restart(2)
    for _ in range(10_000):  # until the log has given node 2 part of what it lost
        held = len(cluster.nodes[2].disk.batches.get("a", []))
        if 0 < held < answered and not cluster.nodes[2].disk.unsynced:
            break
        assert cluster.run(1) == 1
    else:
        raise AssertionError("node 2 never held part of the log")
    cluster.kill(1)
    for index in reversed(range(len(cluster.network))):
        if cluster.network[index][0] == 1:
            cluster.lose(index)  # the rest of the log never arrives
    cluster.cut_from_etcd.clear()
    cluster.settle(rounds=ROUNDS, check=True)
    record = cluster.current("a")
    assert record.node_id == 1 and record.epoch == 1  # node 2 did not take over


def test_a_removed_followers_replica_moves_to_a_live_node_that_catches_up_and_joins() -> None:
    cluster = SimCluster(nodes=4, replicas=3)
    assert cluster.current("a").replicas == (1, 2, 3)
    assert removed(cluster, 3)
    assert cluster.current("a").replicas == (1, 2, 4) and 3 not in cluster.current("a").isr
    assert cluster.write(1, "a", settle=False)
    cluster.settle(rounds=ROUNDS, check=True)
    record = cluster.current("a")
    assert record.node_id == 1 and set(record.isr) == {1, 2, 4}
    assert cluster.nodes[4].disk.data["a"] == cluster.nodes[1].disk.data["a"]
    assert cluster.nodes[4].disk.positions["a"].whole


def test_a_removed_node_that_comes_back_drops_its_copy_and_never_leads() -> None:
    """The node was the leader: an in-sync follower takes the queue over, and the
    node, started again, holds no copy of a queue it is no longer a replica of."""
    cluster = SimCluster(nodes=4, replicas=3)
    assert removed(cluster, 1)
    cluster.settle(rounds=ROUNDS, check=True)
    record = cluster.current("a")
    assert record.node_id in (2, 3) and set(record.isr) == {2, 3, 4}
    assert cluster.write(record.node_id, "a", settle=True)
    cluster.restart(1)
    cluster.settle(rounds=ROUNDS, check=True)
    assert cluster.current("a").node_id == record.node_id
    node = cluster.nodes[1]
    assert node.replicator is not None and not node.replicator.leads("a")
    assert "a" not in node.disk.positions and not node.disk.data.get("a")


def test_a_leader_removed_while_cut_from_etcd_stops_leading_once_it_sees_the_removal() -> None:
    """Its membership key ran out while it was cut off, so `remove-node` took it: back in
    touch with etcd on a new lease, it must neither lead nor keep a copy of the queue."""
    cluster = SimCluster(nodes=4, replicas=3)
    cluster.cut_from_etcd.add(1)
    cluster.advance(TTL_MS + 100)
    assert cluster.remove_node(1)
    cluster.cut_from_etcd.clear()
    cluster.settle(rounds=ROUNDS, check=True)
    node = cluster.nodes[1]
    assert node.replicator is not None and not node.replicator.leads("a")
    assert not cluster.write(1, "a", settle=False)
    assert "a" not in node.disk.positions and not node.disk.data.get("a")
    record = cluster.current("a")
    assert record.node_id in (2, 3) and set(record.isr) == {2, 3, 4}


def test_a_node_made_a_replica_again_after_its_removal_starts_from_nothing() -> None:
    """It dropped its copy when it saw the removal; chosen again (another node's
    removal), it must catch up from the leader, not stand on what it held before."""
    cluster = SimCluster(nodes=4, replicas=3)
    assert removed(cluster, 3)
    cluster.settle(rounds=ROUNDS, check=True)
    cluster.restart(3)
    for _ in range(3):
        assert cluster.write(1, "a", settle=True)
    cluster.settle(rounds=ROUNDS, check=True)
    assert removed(cluster, 4)
    assert cluster.current("a").replicas == (1, 2, 3)
    cluster.settle(rounds=ROUNDS, check=True)
    assert set(cluster.current("a").isr) == {1, 2, 3}
    assert cluster.nodes[3].disk.data["a"] == cluster.nodes[1].disk.data["a"]
