"""Cluster mode (SPEC 9) against real processes: etcd from Debian's etcd-server and
three (or more) `fila-server` nodes.

What is shown here, and how:
- placement: queues spread over the nodes, each on the live node owning the fewest;
  names are unique across the cluster even when two nodes create one at once;
- every RPC through every node reaches the queue's owner and is answered as the
  owner answered (status, message, `x-fila-error-kind`); batches and streams are
  split by owner and merged in request order; consumes elsewhere are redirected
  with `x-fila-leader-addr`; a forwarded call is never forwarded again;
- the published `fila-python` 0.2.0 client, through one node's address; `fila_sdk`'s
  consumers (`consume` sync and async, `Worker`) through one node's address, which
  follow the redirect and carry on across the owner's `kill -9` and restart;
- shared state: runtime config (and the throttles it drives) and API keys/ACLs set
  through one node hold on the others;
- failures: `kill -9` of an owner (its queues UNAVAILABLE elsewhere, the others
  unaffected, nothing acknowledged lost or resurrected after its restart); a node cut
  off from a three-member etcd cluster by its network namespace (it stops serving
  within the lease TTL, no queue is served by two nodes, it serves again when the
  link returns); one of three etcd members hung (the nodes leave it out within
  seconds); a node joining; a duplicate node id and a live node's address (however
  written) refused at startup as configuration errors (exit code 2), and a data
  directory of another node refused.
Without `[cluster]` nothing changes (the last test, and every other test file).

Marked `cluster` (about two minutes in all): deselect with `-m "not cluster"`.
"""

from __future__ import annotations

import asyncio
import os
import queue as queues
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from support import ServerProcess, unique, wait_until
from support.cli import ok, ok_json
from support.cluster import (
    LEASE_TTL_MS,
    LONG_LEASE_MS,
    Cluster,
    Netns,
    cluster,
    lease_kept,
    node_config,
    paused,
    require_etcd,
    require_netns,
)
from support.stubs import RPC_TIMEOUT_S, Fila, error_kind, rpc_error, status_of

from fila.testing.children import free_port
from fila.testing.etcd import EtcdCluster
from fila.testing.server import ServerStartError
from fila.v1 import admin_pb2, service_pb2
from fila.wire import LEADER_ADDR_METADATA_KEY

pytestmark = pytest.mark.cluster

BOOT = "cluster-test-bootstrap-key"
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Three nodes with auth on (every call carries the bootstrap key unless a test
    says otherwise), shared by the tests that change nothing but their own queues.
    Their lease is long: none of them waits for an expiry, and a node starved for a
    second on a loaded CI machine must not be fenced under them."""
    with cluster(
        tmp_path_factory.mktemp("shared"), 3, bootstrap_key=BOOT, lease_ttl_ms=LONG_LEASE_MS
    ) as made:
        yield made


def spread(made: Cluster, prefix: str, via: int = 1) -> dict[int, str]:
    """Creates queues through node `via` until every live node owns one of them,
    checking each lands on a node that owned the fewest queues; {node: queue}."""
    fila = made.fila(via)
    placed: dict[int, str] = {}

    def counts() -> dict[int, int]:
        status = fila.admin.ClusterStatus(admin_pb2.ClusterStatusRequest(), timeout=RPC_TIMEOUT_S)
        return {n.node_id: n.queue_count for n in status.nodes if n.up}

    # Earlier tests may leave one node with more queues (races won by one node): the
    # others are filled up to it first, then one more create lands on each node.
    before = counts()
    top = max(before.values())
    for attempt in range(sum(top - c for c in before.values()) + len(before)):
        counts_now = counts()
        name = f"{prefix}-{attempt}-{uuid.uuid4().hex[:6]}"
        fila.create_queue(name)
        owner = made.leaders(via)[name]
        assert counts_now[owner] == min(counts_now.values()), (name, owner, counts_now)
        placed.setdefault(owner, name)
        if len(placed) == len(counts_now):
            return placed
    raise AssertionError(f"queues did not spread: {placed}")


# -- placement and routing ----------------------------------------------------------------------


def test_queues_spread_over_nodes_and_every_node_lists_them(shared: Cluster) -> None:
    on = spread(shared, "spread")
    assert sorted(on) == [1, 2, 3]
    for via in (1, 2, 3):
        reply = shared.fila(via).list_queues()
        assert reply.cluster_node_count == 3
        leaders = {q.name: q.leader_node_id for q in reply.queues}
        for owner, name in on.items():
            assert leaders[name] == owner
            assert leaders[name + ".dlq"] == owner  # a DLQ lives with its queue
        status = shared.fila(via).admin.ClusterStatus(admin_pb2.ClusterStatusRequest())
        assert status.enabled and status.node_id == via
        assert [(n.node_id, n.up) for n in status.nodes] == [(1, True), (2, True), (3, True)]
        assert {n.node_id: n.advertise_addr for n in status.nodes} == {
            i: shared.node(i).addr for i in (1, 2, 3)
        }


def test_a_queue_name_is_unique_across_the_cluster(shared: Cluster) -> None:
    first = unique("taken")
    shared.fila(1).create_queue(first)
    for via in (1, 2, 3):
        create = shared.fila(via).admin.CreateQueue
        err = rpc_error(create, admin_pb2.CreateQueueRequest(name=first))
        assert status_of(err) == (
            grpc.StatusCode.ALREADY_EXISTS,
            f'queue "{first}" already exists',
            "queue_already_exists",
        )
    # Two creates of one name at the same moment, through two nodes: exactly one wins.
    for _round in range(5):
        name = unique("race")
        barrier = threading.Barrier(2)
        outcomes: list[grpc.StatusCode] = []

        def create(
            via: int, name: str, barrier: threading.Barrier, outcomes: list[grpc.StatusCode]
        ) -> None:
            admin = shared.fila(via).admin
            barrier.wait()
            try:
                admin.CreateQueue(admin_pb2.CreateQueueRequest(name=name), timeout=RPC_TIMEOUT_S)
                outcomes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                outcomes.append(exc.code())

        threads = [
            threading.Thread(target=create, args=(via, name, barrier, outcomes)) for via in (2, 3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sorted(outcomes, key=str) == sorted(
            [grpc.StatusCode.OK, grpc.StatusCode.ALREADY_EXISTS], key=str
        ), outcomes
        assert name in shared.leaders(1)
    # The same race between two nodes that each believe they were chosen (as two
    # nodes with different views of the counts would): etcd's transaction decides.
    for _round in range(5):
        name = unique("claim")
        barrier = threading.Barrier(2)
        outcomes = []

        def chosen(via: int, name: str, barrier: threading.Barrier, outcomes: list[Any]) -> None:
            admin = shared.fila(via).admin
            barrier.wait()
            try:
                admin.CreateQueue(
                    admin_pb2.CreateQueueRequest(name=name),
                    metadata=(("x-fila-forwarded-by", "9"),),
                    timeout=RPC_TIMEOUT_S,
                )
                outcomes.append(via)
            except grpc.RpcError as exc:
                outcomes.append(exc.code())

        threads = [
            threading.Thread(target=chosen, args=(via, name, barrier, outcomes)) for via in (2, 3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        winners = [o for o in outcomes if isinstance(o, int)]
        assert len(winners) == 1 and grpc.StatusCode.ALREADY_EXISTS in outcomes, outcomes
        assert shared.leaders(1)[name] == winners[0]


def test_every_rpc_through_every_node_reaches_the_owner(shared: Cluster) -> None:
    on = spread(shared, "rpc")
    for via in (1, 2, 3):
        fila = shared.fila(via)
        for owner, queue in on.items():
            at_owner = shared.fila(owner)
            first = fila.enqueue(queue, b"one", {"via": str(via)})
            second = fila.enqueue(queue, b"two")
            stats = fila.stats(queue)
            assert (stats.leader_node_id, stats.depth) == (owner, 2)
            peeked = fila.admin.PeekMessages(admin_pb2.PeekMessagesRequest(queue=queue))
            assert [m.id for m in peeked.messages] == [first, second]

            # Consume is served by the owner only: elsewhere it names the owner.
            if via != owner:
                call = fila.svc.Consume(service_pb2.ConsumeRequest(queue=queue))
                with pytest.raises(grpc.RpcError) as raised:
                    next(iter(call))
                err = raised.value
                assert err.code() == UNAVAILABLE
                trailers: Any = err.trailing_metadata() or ()
                assert dict(trailers)[LEADER_ADDR_METADATA_KEY] == shared.node(owner).addr
                assert error_kind(err) == "unavailable"
            with at_owner.consume(queue) as stream:
                got = stream.take(2)
            assert [m.id for m in got] == [first, second]

            # Settlement through `via`: extend, nack (retried at once), ack.
            fila.svc.ExtendLease(
                service_pb2.ExtendLeaseRequest(queue=queue, message_id=first, extend_ms=60_000),
                timeout=RPC_TIMEOUT_S,
            )
            fila.nack(queue, first, "later")
            with at_owner.consume(queue) as stream:
                again = stream.get()
            assert (again.id, again.metadata.attempt_count) == (first, 1)
            fila.ack(queue, first)
            fila.ack(queue, second)
            assert fila.stats(queue).depth == 0

            # A failure is answered as the owner answers it: status, message and kind.
            here = rpc_error(fila.svc.Ack, service_pb2.AckRequest(queue=queue, message_id=first))
            there = rpc_error(
                at_owner.svc.Ack, service_pb2.AckRequest(queue=queue, message_id=first)
            )
            assert status_of(here) == status_of(there)
            assert status_of(here)[0] == grpc.StatusCode.NOT_FOUND
            assert error_kind(here) == "message_not_found"

        missing = rpc_error(fila.svc.Enqueue, service_pb2.EnqueueRequest(queue=unique("none")))
        assert missing.code() == grpc.StatusCode.NOT_FOUND
        assert error_kind(missing) == "queue_not_found"


def test_batches_are_split_by_owner_and_merged_in_request_order(shared: Cluster) -> None:
    on = spread(shared, "batch")
    queues = [on[1], on[2], on[3]]
    gone = unique("missing")
    for via in (1, 2, 3):
        fila = shared.fila(via)
        items = [service_pb2.EnqueueRequest(queue=q, payload=f"{via}-{q}".encode()) for q in queues]
        items.insert(1, service_pb2.EnqueueRequest(queue=gone))
        items.append(service_pb2.EnqueueRequest(queue=""))
        results = fila.svc.EnqueueBatch(
            service_pb2.EnqueueBatchRequest(messages=items), timeout=RPC_TIMEOUT_S
        ).results
        assert [r.WhichOneof("result") for r in results] == [
            "message_id", "error", "message_id", "message_id", "error"
        ]  # fmt: skip
        assert (results[1].error.code, results[1].error.kind) == (5, "queue_not_found")
        assert results[1].error.message == f'queue "{gone}" not found'
        assert results[4].error.kind == "invalid_argument"
        ids = {q: results[i].message_id for i, q in zip((0, 2, 3), queues, strict=True)}
        for owner, queue in on.items():
            peek = shared.fila(owner).admin.PeekMessages(admin_pb2.PeekMessagesRequest(queue=queue))
            assert [m.id for m in peek.messages] == [ids[queue]]

        leased = {}
        for owner, queue in on.items():
            with shared.fila(owner).consume(queue) as stream:
                leased[queue] = stream.get().id
        acks = [service_pb2.AckRequest(queue=q, message_id=leased[q]) for q in queues]
        acks.insert(2, service_pb2.AckRequest(queue=on[3], message_id=str(uuid.uuid4())))
        ack_results = fila.svc.AckBatch(
            service_pb2.AckBatchRequest(acks=acks), timeout=RPC_TIMEOUT_S
        ).results
        assert [r.kind for r in ack_results] == ["", "", "message_not_found", ""]
        for queue in queues:
            assert shared.fila(1).stats(queue).depth == 0

        # NackBatch: each nack reaches its owner, which retries the message at once.
        ids = {q: fila.enqueue(q, b"n") for q in queues}
        for owner, queue in on.items():
            with shared.fila(owner).consume(queue) as stream:
                assert stream.get().id == ids[queue]
        nacks = [service_pb2.NackRequest(queue=q, message_id=ids[q], error="x") for q in queues]
        nack_results = fila.svc.NackBatch(
            service_pb2.NackBatchRequest(nacks=nacks), timeout=RPC_TIMEOUT_S
        ).results
        assert [r.code for r in nack_results] == [0, 0, 0]
        for owner, queue in on.items():
            with shared.fila(owner).consume(queue) as stream:
                message = stream.get()
            assert (message.id, message.metadata.attempt_count) == (ids[queue], 1)
            shared.fila(owner).ack(queue, message.id)


def test_stream_enqueue_is_split_by_owner_and_answered_in_order(shared: Cluster) -> None:
    on = spread(shared, "stream")
    queues = [on[1], on[2], on[3]]
    for via in (1, 2, 3):
        requests = [
            service_pb2.StreamEnqueueRequest(
                sequence_number=seq,
                messages=[
                    service_pb2.EnqueueRequest(queue=queues[(seq + i) % 3], payload=b"%d" % seq)
                    for i in range(seq % 4)
                ]
                + ([service_pb2.EnqueueRequest(queue="no-such-queue")] if seq == 5 else []),
            )
            for seq in range(1, 13)
        ]
        answers = list(shared.fila(via).svc.StreamEnqueue(iter(requests), timeout=RPC_TIMEOUT_S))
        assert [a.sequence_number for a in answers] == list(range(1, 13))
        stored: dict[str, list[str]] = {q: [] for q in queues}
        for request, answer in zip(requests, answers, strict=True):
            assert len(answer.results) == len(request.messages)
            for message, result in zip(request.messages, answer.results, strict=True):
                if message.queue == "no-such-queue":
                    assert result.error.kind == "queue_not_found"
                else:
                    stored[message.queue].append(result.message_id)
        for owner, queue in on.items():
            peek = shared.fila(owner).admin.PeekMessages(
                admin_pb2.PeekMessagesRequest(queue=queue, limit=100)
            )
            assert [m.id for m in peek.messages] == stored[queue]
            shared.fila(owner).admin.PurgeQueue(admin_pb2.PurgeQueueRequest(queue=queue))


def test_admin_calls_through_every_node(shared: Cluster) -> None:
    on = spread(shared, "admin")
    failing = 'function on_failure(m) return {action = "dlq"} end'
    for via in (1, 2, 3):
        fila = shared.fila(via)
        for queue in on.values():
            # Purge, through `via`.
            fila.enqueue(queue, b"p")
            purged = fila.admin.PurgeQueue(admin_pb2.PurgeQueueRequest(queue=queue))
            assert purged.purged == 1
        # Create through `via` (placed anywhere), dead-letter, redrive, delete.
        name = unique(f"redrive{via}")
        fila.create_queue(name, on_failure=failing)
        owner = shared.leaders(via)[name]
        message_id = fila.enqueue(name, b"r")
        with shared.fila(owner).consume(name) as stream:
            assert stream.get().id == message_id
        fila.nack(name, message_id, "boom")
        assert fila.stats(name + ".dlq").depth == 1
        redriven = fila.admin.Redrive(admin_pb2.RedriveRequest(dlq_queue=name + ".dlq"))
        assert redriven.redriven == 1
        assert fila.stats(name).depth == 1
        fila.delete_queue(name)
        for other in (1, 2, 3):
            assert name not in shared.leaders(other)
        fila.create_queue(name)  # the name is free again, cluster-wide
        fila.delete_queue(name)


def test_runtime_config_is_shared_and_drives_every_owners_throttles(shared: Cluster) -> None:
    on = spread(shared, "config")
    key = unique("app.setting")
    shared.fila(1).admin.SetConfig(admin_pb2.SetConfigRequest(key=key, value="on"))
    for via in (1, 2, 3):  # read back at once through every node
        got = shared.fila(via).admin.GetConfig(admin_pb2.GetConfigRequest(key=key))
        assert got.value == "on"
    throttle = unique("tenant")
    shared.fila(2).admin.SetConfig(
        admin_pb2.SetConfigRequest(key=f"throttle.{throttle}", value="3,9")
    )
    for owner, queue in on.items():  # each owner applies it to its own buckets
        # from its watch, milliseconds later (docs/cluster.md, "Views lag by milliseconds")

        def applied(owner: int = owner, queue: str = queue) -> object:
            stats = shared.fila(owner).stats(queue)
            buckets = {t.key: (t.rate_per_second, t.burst) for t in stats.per_throttle_stats}
            return buckets.get(throttle) == (3.0, 9.0) or False

        wait_until(applied, 5, what=f"node {owner} applying throttle.{throttle}")
    shared.fila(3).admin.SetConfig(admin_pb2.SetConfigRequest(key=key, value=""))
    for via in (1, 2, 3):
        err = rpc_error(shared.fila(via).admin.GetConfig, admin_pb2.GetConfigRequest(key=key))
        assert error_kind(err) == "config_key_not_found"


def test_a_forwarded_call_is_never_forwarded_again(shared: Cluster) -> None:
    on = spread(shared, "loop")
    fila = shared.fila(1)
    marked = (("x-fila-forwarded-by", "9"),)
    err = rpc_error(fila.svc.Enqueue, service_pb2.EnqueueRequest(queue=on[2]), metadata=marked)
    assert err.code() == UNAVAILABLE
    assert "not forwarded again" in (err.details() or "")
    fila.svc.Enqueue(service_pb2.EnqueueRequest(queue=on[1]), metadata=marked)  # its own: served


def test_api_keys_and_acls_made_through_one_node_hold_on_the_others(shared: Cluster) -> None:
    on = spread(shared, "keys")
    created = shared.fila(1).admin.CreateApiKey(admin_pb2.CreateApiKeyRequest(name="tenant"))
    tenant = created.key
    # Authenticated at once on another node (no ACL yet: refused for permission).
    err = rpc_error(shared.fila(2, tenant).svc.Enqueue, service_pb2.EnqueueRequest(queue=on[3]))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    shared.fila(2).admin.SetAcl(
        admin_pb2.SetAclRequest(
            key_id=created.key_id,
            permissions=[
                admin_pb2.AclPermission(kind="produce", pattern=on[3]),
                admin_pb2.AclPermission(kind="consume", pattern=on[3]),
            ],
        )
    )
    for via in (1, 2, 3):
        fila = shared.fila(via, tenant)

        def granted(fila: Fila = fila) -> bool:
            """An ACL change reaches the other nodes through their etcd watch."""
            try:
                fila.enqueue(on[3], b"t")
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                    raise
                return False
            return True

        wait_until(granted, 5, what=f"the granted ACL in force on node {via}")
        denied = rpc_error(
            shared.fila(via, tenant).svc.Enqueue, service_pb2.EnqueueRequest(queue=on[1])
        )
        assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    acl = shared.fila(3).admin.GetAcl(admin_pb2.GetAclRequest(key_id=created.key_id))
    assert sorted(p.kind for p in acl.permissions) == ["consume", "produce"]
    listed = shared.fila(3).admin.ListApiKeys(admin_pb2.ListApiKeysRequest())
    assert created.key_id in {k.key_id for k in listed.keys}

    # Revoked through node 3: refused everywhere, and its open stream on node 3 ends.
    stream = shared.fila(3, tenant).consume(on[3])
    assert [m.payload for m in stream.take(3)] == [b"t"] * 3
    shared.fila(3).admin.RevokeApiKey(admin_pb2.RevokeApiKeyRequest(key_id=created.key_id))
    for via in (1, 2, 3):
        fila = shared.fila(via, tenant)

        def refused(fila: Fila = fila) -> bool:
            try:
                fila.stats(on[3])
            except grpc.RpcError as exc:
                return exc.code() == grpc.StatusCode.UNAUTHENTICATED
            return False

        wait_until(refused, 5, what=f"revoked key refused on node {via}")
    ended = stream.ended(5)
    assert ended.error is not None
    assert ended.error.code() == grpc.StatusCode.UNAUTHENTICATED
    stream.cancel()


def test_published_python_client_through_one_node(shared: Cluster, tmp_path: Path) -> None:
    published_sdk = _install_published(tmp_path)
    on = spread(shared, "pub")
    script = PUBLISHED_SCRIPT
    import json
    import subprocess
    import sys

    args = json.dumps(
        {
            "entry": shared.node(1).addr,
            "queues": {str(k): v for k, v in on.items()},
            "owners": {str(k): shared.node(k).addr for k in on},
            "key": BOOT,
            "prefix": str(published_sdk),
        }
    )
    result = subprocess.run(
        [sys.executable, "-P", "-c", script, args],
        env={"PYTHONPATH": str(published_sdk), "PATH": "/usr/bin:/bin"},
        cwd=published_sdk,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "published-sdk-cluster-ok" in result.stdout
    for queue in on.values():
        assert shared.fila(1).stats(queue).depth == 0


PUBLISHED_SCRIPT = r"""
import json, sys
args = json.loads(sys.argv[1])
import fila
assert fila.__file__.startswith(args["prefix"]), fila.__file__  # the published package
from fila import Client
from fila.errors import MessageNotFoundError

entry = Client(args["entry"], api_key=args["key"])
for node, queue in sorted(args["queues"].items()):
    owner_addr = args["owners"][node]
    first = entry.enqueue(queue, {"node": node}, b"hello")   # forwarded to the owner
    second = entry.enqueue(queue, None, b"world")
    if owner_addr == args["entry"]:
        reader = entry
    else:
        # fila-python 0.2.0 reads the leader hint only where grpc raises at call time,
        # but a stream's error arrives on its first read, which its iterator swallows:
        # through a non-owner its consume ends empty. A client that follows the hint
        # reconnects to the address the broker names, as this one does by hand.
        assert list(entry.consume(queue)) == [], "0.2.0 does not follow the hint"
        reader = Client(owner_addr, api_key=args["key"])
    stream = reader.consume(queue)
    got = next(stream)
    assert (got.id, got.payload, got.headers) == (first, b"hello", {"node": node}), got
    entry.ack(queue, got.id)                                  # ack through the entry node
    got = next(stream)
    assert got.id == second, got
    entry.nack(queue, got.id, "again")                        # nack through the entry node
    again = next(stream)
    assert (again.id, again.attempt_count) == (second, 1), again
    entry.ack(queue, again.id)
    try:
        entry.ack(queue, again.id)
    except MessageNotFoundError:
        pass
    else:
        raise AssertionError("a second ack must fail, as the owner says")
print("published-sdk-cluster-ok")
"""


def _install_published(tmp_path: Path) -> Path:
    import subprocess
    import sys

    target = tmp_path / "published-sdk"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
         str(target), "fila-python==0.2.0"],
        check=True,
        timeout=120,
    )  # fmt: skip
    return target


def test_cli_shows_the_nodes_and_each_queues_node(shared: Cluster) -> None:
    on = spread(shared, "cli")
    addr = shared.node(2).addr
    status = ok_json(addr, "--api-key", BOOT, "cluster", "status")
    assert (status["enabled"], status["node_id"]) == (True, 2)
    assert [(n["node_id"], n["up"]) for n in status["nodes"]] == [(1, True), (2, True), (3, True)]
    assert [n["advertise_addr"] for n in status["nodes"]] == [
        shared.node(i).addr for i in (1, 2, 3)
    ]
    assert "3 of 3 nodes up (as seen by node 2)" in ok(addr, "--api-key", BOOT, "cluster", "status")
    listed = {q["name"]: q for q in ok_json(addr, "--api-key", BOOT, "queue", "list")}
    for owner, queue in on.items():
        assert listed[queue]["node"] == owner
        assert listed[queue + ".dlq"]["node"] == owner
        assert ok_json(addr, "--api-key", BOOT, "queue", "inspect", queue)["node"] == owner
    table = ok(addr, "--api-key", BOOT, "queue", "list").splitlines()
    assert "node" in table[1]  # the header row, under the table's top border
    row = next(line for line in table if on[3] + " " in line)
    assert " 3 " in row


def test_reads_through_another_node_do_not_wait_for_its_watch(tmp_path: Path) -> None:
    """Read-your-writes across nodes, shown with node 2's watch held back 3 s (a test
    seam, see fila.cluster.mirror): a queue, a key and a config value made through
    node 1 are found through node 2 at once, because node 2 asks etcd for what it has
    not seen rather than answer from its copy."""
    require_etcd()
    etcd = EtcdCluster(tmp_path / "etcd").start()
    made = Cluster(tmp_path, etcd, env={"FILA_BOOTSTRAP_APIKEY": BOOT}, api_key=BOOT)
    try:
        made.add(1)
        made.env["FILA_CLUSTER_WATCH_DELAY_MS"] = "3000"
        made.add(2)
        creator, reader = made.fila(1), made.fila(2)
        started = time.monotonic()
        for round_ in range(3):
            name = f"ryw-{round_}"
            creator.create_queue(name)
            reader.enqueue(name, b"x")  # NOT_FOUND if node 2 answered from its copy
            key = creator.admin.CreateApiKey(admin_pb2.CreateApiKeyRequest(name="k")).key
            err = rpc_error(made.fila(2, key).svc.Enqueue, service_pb2.EnqueueRequest(queue=name))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED  # authenticated
            creator.admin.SetConfig(admin_pb2.SetConfigRequest(key=name, value="v"))
            got = reader.admin.GetConfig(admin_pb2.GetConfigRequest(key=name))
            assert got.value == "v"
        assert time.monotonic() - started < 3  # all of it inside the watch's delay
    finally:
        made.close()


# -- failures ------------------------------------------------------------------------------------


def test_kill9_of_an_owner(tmp_path: Path) -> None:
    """Its queues answer a clear UNAVAILABLE on the other nodes, theirs keep working,
    and after its restart nothing it acknowledged is lost or resurrected."""
    with cluster(tmp_path, 3) as made:
        on = spread(made, "crash")
        victim = on[3]
        fila = made.fila(1)
        enqueued = [fila.enqueue(victim, b"%d" % i) for i in range(10)]
        with made.fila(3).consume(victim) as stream:
            leased = [m.id for m in stream.take(4)]
        for message_id in leased[:3]:
            fila.ack(victim, message_id)
        acked = set(leased[:3])

        made.node(3).kill()
        for via in (1, 2):
            entry = made.fila(via)

            def down(entry: Fila = entry) -> str:
                try:
                    entry.enqueue(victim, b"x")
                except grpc.RpcError as exc:
                    if exc.code() == UNAVAILABLE and "which is down" in (exc.details() or ""):
                        return exc.details() or ""
                return ""

            detail = wait_until(down, LEASE_TTL_MS / 1000 + 3, what="owner reported down")
            assert detail == f'queue "{victim}" is on node 3, which is down'
            for owner in (1, 2):  # the other nodes' queues are unaffected
                message_id = entry.enqueue(on[owner], b"ok")
                entry.ack(on[owner], _lease_one(made, owner, on[owner]))
                assert message_id
            batch = entry.svc.EnqueueBatch(
                service_pb2.EnqueueBatchRequest(
                    messages=[
                        service_pb2.EnqueueRequest(queue=on[1]),
                        service_pb2.EnqueueRequest(queue=victim),
                    ]
                ),
                timeout=RPC_TIMEOUT_S,
            ).results
            assert batch[0].message_id
            assert (batch[1].error.code, batch[1].error.message) == (14, detail)
            for queue in (on[1], on[2]):
                made.fila(1).admin.PurgeQueue(admin_pb2.PurgeQueueRequest(queue=queue))

        def counted_down() -> object:  # once etcd expires its lease
            status = ok_json(made.node(1).addr, "cluster", "status")
            return not status["nodes"][2]["up"] and status

        status = wait_until(counted_down, LEASE_TTL_MS / 1000 + 3, what="node 3 counted down")
        assert isinstance(status, dict)
        assert [(n["node_id"], n["up"]) for n in status["nodes"]] == [
            (1, True), (2, True), (3, False)
        ]  # fmt: skip
        assert status["nodes"][2]["queues"] == 1  # its queue waits for it
        assert made.fila(2).list_queues().cluster_node_count == 2
        for via in (1, 2):  # counted down: refused without trying it
            err = rpc_error(made.fila(via).svc.Enqueue, service_pb2.EnqueueRequest(queue=victim))
            assert status_of(err) == (UNAVAILABLE, detail, "unavailable")
        made.node(3).start()

        def back() -> bool:  # every node learns from etcd that node 3 is up again
            try:
                return all(made.fila(via).stats(victim).leader_node_id == 3 for via in (1, 2))
            except grpc.RpcError:
                return False

        wait_until(back, 10, what="the restarted owner answering through nodes 1 and 2")
        peek = made.fila(2).admin.PeekMessages(
            admin_pb2.PeekMessagesRequest(queue=victim, limit=100)
        )
        assert [m.id for m in peek.messages] == [m for m in enqueued if m not in acked]
        stats = made.fila(2).stats(victim)  # ready again, or still leased (not yet expired)
        assert stats.depth + stats.in_flight == len(enqueued) - len(acked)

        # Killed and restarted at once, while etcd still holds its lease: it revokes its
        # predecessor's lease instead of waiting it out.
        with lease_kept(made, 3):
            made.node(3).kill()
            made.node(3).start()
        wait_until(back, 10, what="the owner answering after a quick restart")
        assert "revoking this node's previous lease" in made.node(3).log_text()


def test_calls_forwarded_to_an_owner_that_stops_answering_end_once_it_is_down(
    tmp_path: Path,
) -> None:
    """Node 1 stops answering (SIGSTOP) with calls forwarded to it through node 2: a
    unary call without a deadline, and a StreamEnqueue whose first request is for node
    1's queue and second for node 3's. Once etcd counts node 1 down (its lease TTL),
    each ends with "queue q is on node 1, which is down" instead of waiting for node 1
    (forever, without a deadline), and the stream's answer for node 3's queue, queued
    behind node 1's, goes out too."""
    with cluster(tmp_path, 3) as made:
        on = spread(made, "hang")
        entry = made.fila(2)
        entry.enqueue(on[1], b"warm")  # node 2 has a channel to node 1
        detail = f'queue "{on[1]}" is on node 1, which is down'
        limit = LEASE_TTL_MS / 1000 + 5
        with paused(made.node(1)):
            unary = entry.svc.Enqueue.future(service_pb2.EnqueueRequest(queue=on[1]))
            stream = entry.svc.StreamEnqueue(
                iter(
                    service_pb2.StreamEnqueueRequest(
                        sequence_number=seq, messages=[service_pb2.EnqueueRequest(queue=queue)]
                    )
                    for seq, queue in ((1, on[1]), (2, on[3]))
                ),
                timeout=limit,
            )
            try:
                err = unary.exception(timeout=limit)
            finally:
                unary.cancel()
            assert isinstance(err, grpc.RpcError), err
            assert status_of(err) == (UNAVAILABLE, detail, "unavailable")
            first, second = list(stream)
            assert (first.results[0].error.code, first.results[0].error.message) == (14, detail)
            assert second.sequence_number == 2 and second.results[0].message_id
        wait_until(lambda: _answers(entry, on[1]), 10, what="node 1 answering again")


def test_only_the_cancellation_of_a_cut_channel_reads_as_the_node_down() -> None:
    """A forwarded call cancelled because its node's channel was cut answers "down";
    one whose own task is cancelled (the client left, the server stops) must stay
    cancelled, even when the channel was cut too."""
    from fila.cluster.layout import NodeRecord
    from fila.cluster.peers import Link, cut_off

    async def scenario() -> tuple[bool, bool, bool]:
        addr = f"127.0.0.1:{free_port()}"
        link = Link(NodeRecord(9, addr, 1), grpc.aio.insecure_channel(addr))
        intact = cut_off(link)
        link.cut = True

        async def cancelled() -> bool:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return cut_off(link)
            return True

        task = asyncio.create_task(cancelled())
        await asyncio.sleep(0)
        task.cancel()
        mine = await task
        await link.channel.close()
        return intact, cut_off(link), mine

    assert asyncio.run(scenario()) == (False, True, False)


def test_a_part_for_a_stream_that_ended_is_answered_instead_of_waiting_on_its_write() -> None:
    """The owner's channel cut (it restarted) while a StreamEnqueue part was being
    written: gRPC never finishes a write on a call its closed channel ended, so the
    producer's stream waited forever, every later request behind it (about one owner
    restart in 10-40 under load). Once the stream's reader has ended, the part is
    answered "which is down" and the stream goes on."""
    from fila.cluster.layout import NodeRecord
    from fila.cluster.peers import Link
    from fila.cluster.streams import StreamSplitter, _Pending, _Remote
    from fila.server.owed import OwedAnswers, owed_bytes_bound

    class NeverWritten:
        async def write(self, raw: bytes) -> None:
            await asyncio.Event().wait()

    async def scenario() -> None:
        node = NodeRecord(1, "127.0.0.1:1", 0)
        remote = _Remote(node, Link(node, cast(Any, None)), cast(Any, NeverWritten()))
        remote.reader = asyncio.create_task(asyncio.sleep(0))  # ends, as on the cut
        pending = _Pending(7, 1, OwedAnswers(owed_bytes_bound(1)))
        pending.missing = 1
        remote.parts[1] = (pending, [0], ["q"])
        splitter = StreamSplitter.__new__(StreamSplitter)
        await asyncio.wait_for(splitter._write(remote, b"part"), 5.0)
        assert pending.done.done() and remote.broken is not None
        (answer,) = service_pb2.StreamEnqueueResponse.FromString(pending.answer).results
        assert "which is down" in answer.error.message

    asyncio.run(scenario())


def test_the_etcd_channel_reconnects_at_the_peer_channels_pace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The channel to etcd retries within half a second, as the peer channels do
    (gRPC's default backoff grows to 120 s: after a long etcd outage the nodes stayed
    UNAVAILABLE for tens of seconds after etcd was back)."""
    from fila.cluster.etcd import Etcd
    from fila.cluster.peers import CHANNEL_OPTIONS

    made: list[dict[str, Any]] = []
    real = grpc.aio.insecure_channel

    def capture(target: str, options: Any = None, *args: Any, **kwargs: Any) -> Any:
        made.append(dict(options or ()))
        return real(target, options, *args, **kwargs)

    monkeypatch.setattr(grpc.aio, "insecure_channel", capture)

    async def scenario() -> None:
        etcd = Etcd([f"127.0.0.1:{free_port()}"])
        await etcd.open()
        await etcd.close()

    asyncio.run(scenario())
    backoff = ("grpc.initial_reconnect_backoff_ms", "grpc.max_reconnect_backoff_ms")
    peers = dict(CHANNEL_OPTIONS)
    assert [{k: options.get(k) for k in backoff} for options in made] == [
        {k: peers[k] for k in backoff}
    ]
    assert peers["grpc.max_reconnect_backoff_ms"] <= 500


def test_a_hung_etcd_member_is_left_out_and_the_node_keeps_answering(tmp_path: Path) -> None:
    """One member of a three-member etcd hangs (SIGSTOP: its connections stay open, it
    answers nothing; quorum holds). The node's etcd channel round-robins its calls over
    the members: a third of them went to the hung one and failed after 3 s each, until
    gRPC's ping timeout closed that connection a minute later. Keepalive pings take the
    member out of rotation (fila.cluster.etcd.KEEPALIVE_OPTIONS): within seconds of the
    SIGSTOP every etcd write through the node answers at once, and goes on doing so.
    A follower is stopped, so that no election muddies the measure."""
    require_etcd()
    etcd = EtcdCluster(tmp_path / "etcd", 3).start()
    made = Cluster(tmp_path, etcd)
    hung: int | None = None
    try:
        made.add(1)
        fila = made.fila(1)
        queue = unique("hung-etcd")
        fila.create_queue(queue)
        hung = etcd.pid((etcd.leader() + 1) % 3)
        os.kill(hung, signal.SIGSTOP)
        stopped_at = time.monotonic()
        streak: list[float] = []  # when the writes answered at once since the last that was not

        def writes_answer_at_once() -> bool:
            """True once the writes answered within 1 s each, one after another, for 2 s
            (with the member in rotation, a third of them went to it)."""
            started = time.monotonic()
            try:
                fila.admin.SetConfig(
                    admin_pb2.SetConfigRequest(key="hung", value=f"{started}"), timeout=5
                )
                answered = time.monotonic() - started < 1
            except grpc.RpcError as exc:
                assert exc.code() == UNAVAILABLE, exc
                answered = False
            if not answered:
                streak.clear()
                return False
            streak.append(started)
            return streak[-1] - streak[0] >= 2

        wait_until(writes_answer_at_once, 20, what="2 s of etcd writes answered at once")
        left_out_after = streak[0] - stopped_at
        print(f"hung etcd member: every write answered at once from {left_out_after:.1f}s on")
        assert left_out_after < 12
        assert fila.admin.GetConfig(admin_pb2.GetConfigRequest(key="hung")).value == (
            f"{streak[-1]}"
        )
        fila.enqueue(queue, b"still served")
    finally:
        if hung is not None:
            os.kill(hung, signal.SIGCONT)
        made.close()


def test_an_etcd_read_not_answered_in_a_second_is_made_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reads and lease renewals are hedged (fila.cluster.etcd.Etcd._hedged): one not
    answered after the hedge delay is made again alongside, and the first answer wins,
    so a call that went to a hung member (before the channel leaves it out) costs a
    second instead of failing; both end within the call's timeout, and the one not
    used is cancelled. Fake attempts: (delay, answer), a None answer failing."""
    from fila.cluster import etcd as module
    from fila.cluster.etcd import Etcd, EtcdUnavailable

    monkeypatch.setattr(module, "READ_HEDGE_S", 0.1)
    client = Etcd(["127.0.0.1:1"])  # never opened: the attempts are fakes

    async def run(plan: list[tuple[float, str | None]]) -> tuple[str, list[str]]:
        log: list[str] = []

        def attempt(within_s: float) -> Any:
            index = len(log)
            delay, answer = plan[index]
            log.append(f"{index}:{within_s:.1f}")

            async def one() -> str:
                try:
                    await asyncio.sleep(min(delay, within_s))
                except asyncio.CancelledError:
                    log.append(f"{index}:cancelled")
                    raise
                if answer is None or delay > within_s:
                    raise EtcdUnavailable(f"attempt {index} failed")
                return answer

            return one()

        try:
            got = await client._hedged(attempt, 0.5, module.READ_HEDGE_S)
        except EtcdUnavailable as exc:
            got = str(exc)
        await asyncio.sleep(0.05)  # a cancelled attempt records it
        return got, log

    async def scenario() -> None:
        assert await run([(0, "a")]) == ("a", ["0:0.5"])  # answered: no second attempt
        assert await run([(9, "a"), (0, "b")]) == ("b", ["0:0.5", "1:0.4", "0:cancelled"])
        assert await run([(0.15, None), (0.2, "b")]) == ("b", ["0:0.5", "1:0.4"])
        assert await run([(0.15, "a"), (9, "b")]) == ("a", ["0:0.5", "1:0.4", "1:cancelled"])
        failed, log = await run([(9, "a"), (9, "b")])  # both end at 0.5 s, in either order
        assert failed in ("attempt 0 failed", "attempt 1 failed") and log == ["0:0.5", "1:0.4"]
        assert await run([(0, None)]) == ("attempt 0 failed", ["0:0.5"])  # failed at once

    asyncio.run(scenario())


def test_a_write_on_a_lease_etcd_no_longer_has_is_unavailable(tmp_path: Path) -> None:
    """etcd answers a write on an expired lease with NOT_FOUND ("requested lease not
    found"). A node's join that granted a lease and then waited out its TTL on a hung
    etcd member got it for its create, and the node stopped ("cluster tasks ended
    unexpectedly"); it is EtcdUnavailable now, which the join retries with a new lease.
    Revoking a lease etcd no longer has is still fine."""
    from fila.cluster.etcd import Etcd, EtcdUnavailable

    require_etcd()

    async def scenario(endpoints: list[str]) -> None:
        client = Etcd(endpoints)
        await client.open()
        try:
            lease, _ttl = await client.grant(5)
            await client.revoke(lease)
            await client.revoke(lease)
            with pytest.raises(EtcdUnavailable, match="requested lease not found"):
                await client.create("/fila-test/k", b"v", lease=lease)
            with pytest.raises(EtcdUnavailable, match="requested lease not found"):
                await client.put("/fila-test/k", b"v", lease=lease)
        finally:
            await client.close()

    with EtcdCluster(tmp_path / "etcd") as etcd:
        asyncio.run(scenario(etcd.endpoints))


def test_a_join_whose_create_was_made_again_holds_the_key_it_created() -> None:
    """etcd3aio makes a call again when its connection closed under it (UNAVAILABLE),
    as the etcd channel's keepalive now closes a hung member's: a join's create that
    the first attempt applied is answered "exists", held by the lease the join has
    just granted. That key is the node's own, and it joins; it revoked the new lease
    (and with it the key) and started over. Fakes for etcd and the data directory."""
    from fila.cluster.etcd import Created, Entry
    from fila.cluster.layout import Layout, NodeRecord
    from fila.cluster.lease import NodeLease

    revoked: list[int] = []

    class Etcd:
        async def grant(self, ttl_s: int) -> tuple[int, int]:
            return 0x7E, ttl_s

        async def create(self, key: str, value: bytes, *, lease: int = 0) -> Created:
            return Created(False, Entry(key, value, 5, lease), 5)  # made by the first attempt

        async def revoke(self, lease: int) -> None:
            revoked.append(lease)

    class Identity:
        def last_lease(self) -> int | None:
            return None

        async def record_lease(self, lease: int) -> None:
            pass

    async def scenario() -> None:
        record = NodeRecord(1, "127.0.0.1:1", 0)
        lease = NodeLease(
            cast(Any, Etcd()), Layout("/fila"), record, 2000, cast(Any, Identity()), print
        )
        assert await lease._join()
        assert lease.serving and revoked == []

    asyncio.run(scenario())


def _loopback_name() -> str | None:
    """A host name that resolves only to loopback IPv4 addresses (where the tests' etcd
    listens): this host's own name where it does, else "localhost" (a container's
    name resolves to its network address), else None."""
    for name in (socket.gethostname(), "localhost"):
        try:
            found = socket.getaddrinfo(name, None, socket.AF_INET)
        except OSError:
            continue
        if found and all(info[4][0].startswith("127.") for info in found):
            return name
    return None


def test_etcd_endpoints_become_a_grpc_target() -> None:
    """etcd3aio's own `ipv4:` target takes IPv4 literals only; host names failed every
    call ("target uri is not valid") until the node gave up."""
    from fila.cluster.etcd import EtcdUnavailable, grpc_target

    async def scenario() -> None:
        assert await grpc_target(["10.0.0.1:2379", "localhost:2380"]) == (
            "ipv4:10.0.0.1:2379,127.0.0.1:2380"
        )
        assert await grpc_target(["etcd-0.etcd:2379"]) == "dns:///etcd-0.etcd:2379"
        with pytest.raises(EtcdUnavailable, match=r"etcd\.fila-test\.invalid:2379 does not"):
            await grpc_target(["127.0.0.1:2379", "etcd.fila-test.invalid:2379"])
        name = _loopback_name()
        if name is not None:
            assert await grpc_target([f"{name}:1", "127.0.0.1:2"]) == "ipv4:127.0.0.1:1,127.0.0.1:2"

    asyncio.run(scenario())


def test_a_queue_created_while_the_chosen_node_is_dead_goes_to_a_live_one(
    tmp_path: Path,
) -> None:
    """Node 1 dies (kill -9) and placement would choose it until etcd counts it down
    (its lease TTL): a create in that window answered 'queue x is on node 1, which is
    down' for a queue that did not exist. It is placed on a live node instead."""
    with cluster(tmp_path, 2) as made:
        made.node(1).kill()  # both own no queue: placement would choose node 1
        name = unique("placed")
        made.fila(2).create_queue(name)
        assert made.leaders(2)[name] == 2
        made.fila(2).enqueue(name, b"m")


def test_a_node_reaches_etcd_by_host_name(tmp_path: Path) -> None:
    """Endpoints are host:port, and a host may be a name (a DNS name for an etcd
    member, as in most deployments): the node starts and serves."""
    name = _loopback_name()
    if name is None:
        pytest.skip("this host's name does not resolve to a loopback address")
    with cluster(tmp_path, 0) as made:
        port = made.etcd.endpoints[0].rpartition(":")[2]
        made.add(1, endpoints=[f"{name}:{port}"])
        made.add(2, endpoints=[f"{name}:{port}", f"127.0.0.1:{port}"])
        fila = made.fila(2)
        fila.create_queue("named")
        fila.enqueue("named", b"m")
        assert made.fila(1).stats("named").depth == 1


def test_a_node_without_its_lease_serves_no_queue_even_one_etcd_does_not_place() -> None:
    """A queue with no placement in this node's view (etcd does not know it, or the
    view is stale: a replacement with this node's id released it) is served here only
    while this node holds its lease; without it the node is fenced, as for its own."""
    from fila.clock import ManualClock
    from fila.cluster.errors import Fenced
    from fila.cluster.routing import LOCAL, Router

    class Lease:
        serving = True

        def fenced_error(self) -> Fenced:
            return Fenced("no lease")

    lease = Lease()
    unused = cast(Any, None)  # decide() reads only the lease
    router = Router(1, cast(Any, lease), unused, unused, unused, unused, ManualClock())
    for owner in (None, 1):
        for forwarded in (False, True):
            lease.serving = True
            assert router.decide("q", owner, forwarded=forwarded) is LOCAL
            lease.serving = False
            with pytest.raises(Fenced):
                router.decide("q", owner, forwarded=forwarded)


def _answers(fila: Fila, queue: str) -> bool:
    try:
        fila.stats(queue)
    except grpc.RpcError:
        return False
    return True


def _lease_one(made: Cluster, owner: int, queue: str) -> str:
    with made.fila(owner).consume(queue) as stream:
        return stream.get().id


def test_the_sdk_follows_the_owner_and_survives_its_restart(tmp_path: Path) -> None:
    """fila_sdk consumers given node 1's address only, on queues of node 3: `consume`
    (sync and async) and a `Worker` follow `x-fila-leader-addr` there, and the same
    consumers carry on after node 3 is killed, counted down and started again, with
    nothing they acknowledged delivered again and everything enqueued after delivered.
    (That node 3 keeps what it acknowledged across `kill -9` is `test_kill9_of_an_owner`.)
    """
    from fila_sdk import AsyncClient, Client, Message, UnavailableError, Worker
    from fila_sdk._loop import LoopThread

    with cluster(tmp_path, 3) as made:
        sync_q, async_q, worker_q = (spread(made, f"sdk{i}")[3] for i in range(3))
        entry = made.node(1).addr
        producer = made.fila(2)
        # What each consumer acknowledged (acked, or handled for the worker), in order.
        seen: dict[str, queues.Queue[str]] = {
            q: queues.Queue() for q in (sync_q, async_q, worker_q)
        }
        errors: list[BaseException] = []

        client = Client(entry, reconnect_timeout=60)

        def consume() -> None:
            try:
                for message in client.consume(sync_q):
                    client.ack(sync_q, message.id)
                    seen[sync_q].put(message.id)
            except BaseException as exc:
                errors.append(exc)

        loop = LoopThread("sdk-test-async")

        async def open_async() -> AsyncClient:
            return AsyncClient(entry, reconnect_timeout=60)

        aclient = loop.run(open_async())

        async def consume_async() -> None:
            try:
                async for message in aclient.consume(async_q):
                    await aclient.ack(async_q, message.id)
                    seen[async_q].put(message.id)
            except BaseException as exc:
                errors.append(exc)
                raise

        def handle(message: Message) -> None:
            seen[worker_q].put(message.id)

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        reading = loop.submit(consume_async())
        worker = Worker(client, worker_q, handle, concurrency=2)
        worker.start()
        try:

            def every_consumer_gets(round_: int) -> None:
                sent = {q: {producer.enqueue(q, b"%d" % i) for i in range(3)} for q in seen}
                for q, inbox in seen.items():
                    got = []
                    for _ in range(3):
                        try:
                            got.append(inbox.get(timeout=20))
                        except queues.Empty:
                            raise AssertionError((round_, q, got, errors)) from None
                    assert set(got) == sent[q], (round_, q)  # none of an earlier round
                wait_until(
                    lambda: all(
                        (s.depth, s.in_flight) == (0, 0) for s in map(producer.stats, seen)
                    ),
                    10,
                    what="every message settled on node 3",
                )
                assert all(inbox.empty() for inbox in seen.values())

            every_consumer_gets(1)
            made.node(3).kill()
            wait_until(
                lambda: not ok_json(entry, "cluster", "status")["nodes"][2]["up"],
                LEASE_TTL_MS / 1000 + 3,
                what="node 3 counted down",
            )
            [refused] = client.enqueue_many(sync_q, [b"refused"])  # meanwhile, through node 1
            assert isinstance(refused, UnavailableError) and "which is down" in str(refused)
            made.node(3).start()
            wait_until(lambda: producer.list_queues().cluster_node_count == 3, 10, what="node 3 up")
            every_consumer_gets(2)  # the same consumers, still given node 1's address only
            assert worker.stats.resubscribed >= 1
            assert errors == []
        finally:
            worker.stop()
            worker.join(30)
            client.close()
            reader.join(10)
            loop.run(aclient.close())
            reading.result(10)
            loop.stop()
        assert not reader.is_alive() and errors == []


def test_a_node_joins_and_new_queues_go_to_it(tmp_path: Path) -> None:
    with cluster(tmp_path, 2) as made:
        fila = made.fila(1)
        for i in range(4):
            fila.create_queue(f"before-{i}")
        assert sorted(made.leaders(2).values()) == [1, 1, 1, 1, 2, 2, 2, 2]
        made.add(3)
        wait_until(lambda: fila.list_queues().cluster_node_count == 3, 5, what="node 3 up")
        for i in range(2):  # node 3 owns the fewest: it gets the next queues
            fila.create_queue(f"after-{i}")
            assert made.leaders(2)[f"after-{i}"] == 3
        fila.enqueue("after-0", b"x")
        assert made.fila(3).stats("after-0").depth == 1

        # A second process claiming a live node's id is refused at startup...
        port = free_port()
        twin = ServerProcess(
            tmp_path / "twin" / "data",
            config_toml=node_config(2, f"127.0.0.1:{port}", made.etcd.endpoints),
            port=port,
        )
        with pytest.raises(ServerStartError, match="node id 2 is held in etcd by another"):
            twin.start(timeout=30)
        # ... and so is a data directory of another node.
        made.node(3).stop()
        port = free_port()
        moved = ServerProcess(
            made.node(3).data_dir,
            config_toml=node_config(4, f"127.0.0.1:{port}", made.etcd.endpoints),
            port=port,
        )
        error, _ = _refused_as_bad_config(moved)
        assert "belongs to cluster node 3, not 4" in error


def test_a_node_at_another_live_nodes_address_is_refused(tmp_path: Path) -> None:
    """Two live nodes may not advertise one address (a copied config): the others
    forward a node's calls to the address in its record, so node 3 at node 2's address
    received node 2's calls and node 2 node 3's. Node 3 is refused at startup, once
    node 2 has outlived the wait for a dead predecessor's lease, with exit code 2 (a
    configuration error), and never appears in the cluster. A node restarting under its
    own id and address joins as ever, and a node at the address of one that died under
    another id joins once etcd has counted that one down."""
    with cluster(tmp_path, 2) as made:
        taken = made.node(2).addr
        twin = ServerProcess(
            tmp_path / "twin" / "data",
            config_toml=node_config(3, taken, made.etcd.endpoints),
            port=free_port(),
        )

        def nodes_up() -> list[tuple[int, str]]:
            status = made.fila(1).admin.ClusterStatus(admin_pb2.ClusterStatusRequest())
            return [(n.node_id, n.advertise_addr) for n in status.nodes if n.up]

        try:
            with pytest.raises(ServerStartError, match="exited with code 2 before serving") as no:
                twin.start(timeout=30)
            assert f"advertise_addr {taken} is advertised by live node 2" in str(no.value)
            assert "not joining yet" in twin.log_text()  # said at once, not after the wait
            assert nodes_up() == [(1, made.node(1).addr), (2, taken)]

            with lease_kept(made, 2):  # its record stays live for the lease TTL...
                made.node(2).kill()
                made.node(2).start()  # ...and does not count against its own id
            log = made.node(2).log_text()
            assert "revoking this node's previous lease" in log and "not joining yet" not in log
            made.fila(2).create_queue(unique("back"))
            expected = [(1, made.node(1).addr), (2, taken)]
            wait_until(lambda: nodes_up() == expected, 5, what="node 2 up again")

            made.node(2).kill()  # node 3 takes over the address of a node that died
            twin.start(timeout=30)
            expected = [(1, made.node(1).addr), (3, taken)]
            wait_until(lambda: nodes_up() == expected, 5, what="node 3 up at node 2's address")
        finally:
            if twin.running:
                twin.stop()


def _live_nodes(made: Cluster) -> list[tuple[int, str]]:
    status = made.fila(1).admin.ClusterStatus(admin_pb2.ClusterStatusRequest())
    return [(n.node_id, n.advertise_addr) for n in status.nodes if n.up]


def _refused_as_bad_config(twin: ServerProcess) -> tuple[str, float]:
    """Starts `twin`, which must exit with code 2 (a configuration error) before it
    serves; its error and how long it took to give up."""
    began = time.monotonic()
    with pytest.raises(ServerStartError, match="exited with code 2 before serving") as no:
        twin.start(timeout=30)
    return str(no.value), time.monotonic() - began


def test_a_second_live_node_with_one_node_id_is_refused_as_a_configuration_error(
    tmp_path: Path,
) -> None:
    """A node started with the id of a live node (a copied config, a FILA_NODE_ID
    reused) exited with code 1, which systemd restarts (Restart=on-failure) into the
    same refusal, forever; it is a configuration error, exit code 2, as a live node's
    address is. It says at once why it waits, waits as for a dead predecessor (2 TTL +
    1 s), then names the node holding the id. That wait is why: a node replaced under
    its id (new data directory, so no recorded lease to revoke) whose predecessor died
    joins once etcd has counted the predecessor down."""
    with cluster(tmp_path, 2) as made:
        holder = made.node(2).addr
        port = free_port()
        twin = ServerProcess(
            tmp_path / "twin" / "data",
            config_toml=node_config(2, f"127.0.0.1:{port}", made.etcd.endpoints),
            port=port,
        )
        try:
            error, took = _refused_as_bad_config(twin)
            assert f"node id 2 is held in etcd by another live node (at {holder}, " in error
            assert "Give this node an id of its own" in error
            assert took >= 2 * LEASE_TTL_MS / 1000 + 1  # a dead holder's lease expires first
            assert "not joining yet: node id 2 is held" in twin.log_text()
            assert _live_nodes(made) == [(1, made.node(1).addr), (2, holder)]

            made.node(2).kill()  # its lease outlives it by up to the TTL
            twin.start(timeout=30)
            expected = [(1, made.node(1).addr), (2, twin.addr)]
            wait_until(lambda: _live_nodes(made) == expected, 5, what="node 2 replaced")
        finally:
            if twin.running:
                twin.stop()


def test_a_live_nodes_address_written_another_way_is_refused(tmp_path: Path) -> None:
    """advertise_addr was compared as text: node 3 at "LOCALHOST:<port>" joined while
    node 2 advertised "127.0.0.1:<port>", one listener that both nodes' forwarded calls
    reached. Addresses are compared by the socket address they name, so node 3 is
    refused (exit code 2) naming node 2 and how node 2 wrote it. A host name that does
    not resolve is compared as text, with a warning, and its node starts."""
    with cluster(tmp_path, 2) as made:
        taken = made.node(2).addr
        port = int(taken.rpartition(":")[2])
        spelled = f"LOCALHOST:{port}"
        if not socket.gethostbyname("localhost").startswith("127."):
            pytest.skip("localhost does not resolve to a loopback address here")
        twin = ServerProcess(
            tmp_path / "twin" / "data",
            config_toml=node_config(3, spelled, made.etcd.endpoints),
            port=free_port(),
        )
        elsewhere = ServerProcess(
            tmp_path / "elsewhere" / "data",
            config_toml=node_config(4, f"node-4.fila-test.invalid:{port}", made.etcd.endpoints),
            port=free_port(),
        )
        try:
            error, _took = _refused_as_bad_config(twin)
            assert f"advertise_addr {spelled} is advertised by live node 2 (as {taken})" in error
            assert _live_nodes(made) == [(1, made.node(1).addr), (2, taken)]

            elsewhere.start(timeout=30)
            assert "node-4.fila-test.invalid:" in elsewhere.log_text()
            assert "does not resolve here" in elsewhere.log_text()
            wait_until(lambda: len(_live_nodes(made)) == 3, 5, what="node 4 up")
        finally:
            for proc in (twin, elsewhere):
                if proc.running:
                    proc.stop()


def test_advertise_addresses_are_compared_by_the_socket_address_they_name() -> None:
    """The one comparison (fila.cluster.address), without processes: spellings of one
    socket address are one; a name that does not resolve, or whose resolver does not
    answer, is compared as text, and the event loop runs on meanwhile."""
    from fila.cluster.address import Addresses

    async def scenario() -> None:
        addresses = Addresses()
        same = [
            ("[::1]:5555", "[0:0:0:0:0:0:0:1]:5555"),
            ("[::1]:5555", "::1:5555"),
            ("127.0.0.1:5555", "127.0.0.1:05555"),
            ("[::ffff:127.0.0.1]:5555", "127.0.0.1:5555"),
            ("Node-1.fila-test.invalid:5555", "node-1.fila-test.invalid.:5555"),
        ]
        if socket.gethostbyname("localhost").startswith("127.0.0.1"):
            same.append(("127.0.0.1:5555", "LocalHost:5555"))
        for a, b in same:
            assert await addresses.same(a, b), (a, b)
        for a, b in [
            ("127.0.0.1:5555", "127.0.0.1:5556"),
            ("127.0.0.1:5555", "127.0.0.2:5555"),
            ("a.fila-test.invalid:5555", "b.fila-test.invalid:5555"),
        ]:
            assert not await addresses.same(a, b), (a, b)

        loop = asyncio.get_running_loop()

        async def silent(*_args: object, **_kwargs: object) -> list[Any]:
            await asyncio.Event().wait()  # a resolver that never answers
            return []

        loop.getaddrinfo = silent  # type: ignore[method-assign]
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = loop.create_task(tick())
        slow = Addresses(timeout_s=0.3)
        began = loop.time()
        async with asyncio.timeout(5):  # a comparison that waits on the resolver fails
            assert await slow.same("x.example:1", "X.example.:1")
            assert not await slow.same("x.example:1", "y.example:1")
        assert loop.time() - began < 2 and ticks >= 10
        ticker.cancel()

    asyncio.run(scenario())


def test_a_node_cut_off_from_etcd_stops_serving_and_no_queue_has_two_servers(
    tmp_path: Path,
) -> None:
    """Node 1 runs in its own network namespace: clients reach it over one veth pair,
    a three-member etcd (in a namespace of its own) over another. Cutting the etcd link
    must stop node 1 serving its queues within the lease TTL (plus a small margin),
    while a client tries every node all along; when the link returns node 1 serves
    again. Every enqueue answered during the whole run is in node 1's queue."""
    require_etcd()
    require_netns()
    nets = Netns()
    made: Cluster | None = None
    try:
        etcd_ns = nets.namespace("e")
        node_ns = nets.namespace("n")
        _root_e, etcd_host, _ = nets.link("e", None, etcd_ns)  # root <-> etcd
        _root_c, node_host, _ = nets.link("c", None, node_ns)  # clients <-> node 1
        etcd_side, node_etcd_host, cut_iface = nets.link("x", etcd_ns, node_ns)  # node 1 <-> etcd
        etcd = EtcdCluster(
            tmp_path / "etcd",
            3,
            host=etcd_host,
            extra_client_hosts=(etcd_side,),
            wrapper=nets.wrapper(etcd_ns),
        ).start()
        made = Cluster(tmp_path, etcd)
        made.add(
            1,
            host=node_host,
            wrapper=nets.wrapper(node_ns),
            endpoints=etcd.endpoints_on(etcd_side),
        )
        made.add(2)
        made.add(3)
        assert node_etcd_host
        queue = unique("fenced")
        made.fila(1).create_queue(queue)
        assert made.leaders(2)[queue] == 1
        other = unique("elsewhere")
        made.fila(2).create_queue(other)
        assert made.leaders(2)[other] == 2

        probes: list[tuple[float, int, str]] = []  # (time, node, message id or "")
        stop = threading.Event()

        def probe() -> None:
            clients = {via: made.fila(via) for via in (1, 2, 3)}
            while not stop.is_set():
                for via, client in clients.items():
                    try:
                        reply = client.svc.Enqueue(
                            service_pb2.EnqueueRequest(queue=queue, payload=b"p"), timeout=2
                        )
                        probes.append((time.monotonic(), via, reply.message_id))
                    except grpc.RpcError as exc:
                        assert exc.code() in (UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                        probes.append((time.monotonic(), via, ""))
                time.sleep(0.02)  # paces the probe; nothing waits on it

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        wait_until(lambda: len(probes) > 30, 10, what="probes before the cut")
        consumer = made.fila(1).consume(queue)  # served by node 1: must end with the lease
        consumer.get()

        cut_at = time.monotonic()
        nets.set_link(node_ns, cut_iface, up=False)
        ttl = LEASE_TTL_MS / 1000

        def fenced_on_node_1() -> bool:
            return any(t > cut_at and v == 1 and not mid for t, v, mid in probes)

        wait_until(fenced_on_node_1, ttl + 1, what="node 1 refusing its queue")
        fenced_after = min(t for t, v, mid in probes if t > cut_at and v == 1 and not mid) - cut_at
        assert fenced_after <= ttl + 0.5, f"node 1 served {fenced_after:.2f}s after the cut"
        wait_until(
            lambda: any(t > cut_at + ttl + 1 for t, _v, _mid in probes), 5, what="probes"
        )  # the probe ran on past the fence, through every node
        served_late = [(t - cut_at, v) for t, v, mid in probes if mid and t > cut_at + ttl + 0.25]
        assert served_late == [], f"served after the lease TTL: {served_late[:5]}"
        wait_until(lambda: consumer.done, 1, what="node 1's consume stream ended")
        assert consumer.error is not None and consumer.error.code() == UNAVAILABLE
        assert "lost its etcd lease" in (consumer.error.details() or "")
        consumer.cancel()
        # The other nodes' queues keep working meanwhile.
        made.fila(3).enqueue(other, b"fine")

        restored_at = time.monotonic()
        nets.set_link(node_ns, cut_iface, up=True)

        def serving_everywhere() -> bool:
            recent = [(v, mid) for t, v, mid in probes if t > restored_at]
            return {v for v, mid in recent if mid} == {1, 2, 3}

        wait_until(serving_everywhere, 15, what="node 1 serving again through every node")
        stop.set()
        prober.join(10)
        print(
            f"fencing: node 1 refused {fenced_after:.2f}s after the cut (lease TTL {ttl:.1f}s); "
            f"served again through every node {time.monotonic() - restored_at:.2f}s after "
            "the link returned (at most; the probe paces it)"
        )

        # Nothing answered was served by another node: all of it is in node 1's queue.
        answered = [mid for _t, _v, mid in probes if mid]
        peek = made.fila(1).admin.PeekMessages(
            admin_pb2.PeekMessagesRequest(queue=queue, limit=1000)
        )
        assert [m.id for m in peek.messages] == answered[: len(peek.messages)]
        assert len(peek.messages) == min(len(answered), 1000)
        assert made.leaders(3)[queue] == 1
    finally:
        if made is not None:
            made.close()
        nets.close()


# -- single node ---------------------------------------------------------------------------------


def test_etcd_starts_again_on_new_ports_when_one_was_taken(tmp_path: Path) -> None:
    """A port chosen free can be taken before etcd binds it (the three-member cluster
    of the fencing test once lost one to a connection between its first members)."""
    require_etcd()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        etcd = EtcdCluster(tmp_path / "etcd", 3)
        etcd._peer[2] = taken.getsockname()[1]
        etcd.start()
        try:
            assert taken.getsockname()[1] not in etcd._peer
            assert "address already in use" in (tmp_path / "etcd" / "m2.attempt1.log").read_text()
        finally:
            etcd.stop()


def test_without_cluster_section_the_broker_is_one_node(server: ServerProcess) -> None:
    from support.stubs import connect

    with connect(server.addr) as fila:
        fila.create_queue("solo")
        listing = fila.list_queues()
        assert listing.cluster_node_count == 1
        assert {q.leader_node_id for q in listing.queues} == {0}
        assert fila.stats("solo").leader_node_id == 0
        status = fila.admin.ClusterStatus(admin_pb2.ClusterStatusRequest())
        assert status == admin_pb2.ClusterStatusResponse(enabled=False)
    assert "Not in cluster mode" in ok(server, "cluster", "status")
    assert ok_json(server, "queue", "list")[0] == {
        "name": "solo", "depth": 0, "in_flight": 0, "active_consumers": 0
    }  # fmt: skip
    assert "node" not in ok_json(server, "queue", "inspect", "solo")
    assert "fila.cluster" not in server.log_text()


def test_the_cluster_benchmark_runs(tmp_path: Path) -> None:
    """`fila-bench system`'s cluster cases, with tiny windows: every figure present."""
    import json
    import subprocess
    import sys

    require_etcd()
    out = tmp_path / "results.json"
    argv = [sys.executable, "-m", "fila_bench", "system", "--quick", "--only", "cluster_*",
            "--measure-seconds", "0.3", "--warmup-seconds", "0", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = {b["name"]: b["value"] for b in json.loads(out.read_text())["benchmarks"]}
    for name in (
        "cluster_enqueue_owner_8c",
        "cluster_enqueue_forwarded_8c",
        "cluster_enqueue_owner_p50",
        "cluster_enqueue_forwarded_p50",
        "cluster_recovery_ms",
    ):
        assert figures[name] > 0, name
    assert "cluster_forwarding_cost_pct" in figures
