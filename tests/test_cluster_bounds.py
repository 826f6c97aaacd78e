"""Cluster mode: what a client can make a node hold is bounded.

Against real etcd and `fila-server` nodes (`support.cluster`): a `StreamEnqueue`
through a node that does not own its queue, from a client that never reads
(`support.h2raw`, receive window zero), is read no further than a single node's
stream once it owes its bound of answers (`fila.server.owed`).

Marked `cluster`: deselect with `-m "not cluster"`.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from support import resident_bytes_of, settled, wait_until
from support.cluster import Cluster, cluster
from support.h2raw import RawH2Connection
from support.stubs import RPC_TIMEOUT_S

from fila.v1 import admin_pb2, service_pb2

pytestmark = pytest.mark.cluster

BOOT = "cluster-bounds-bootstrap-key"
MIB = 1024 * 1024
STREAM_ENQUEUE = "/fila.v1.FilaService/StreamEnqueue"


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Two nodes with auth on; every channel carries the bootstrap key unless told."""
    with cluster(tmp_path_factory.mktemp("bounds"), 2, bootstrap_key=BOOT) as made:
        yield made


def _queue_on(made: Cluster, owner: int) -> str:
    """A new queue placed on node `owner` (created through node 1)."""
    fila = made.fila(1)
    for _ in range(10):
        name = f"q-{uuid.uuid4().hex[:8]}"
        fila.create_queue(name)
        if made.leaders(1)[name] == owner:
            return name
    raise AssertionError(f"no queue landed on node {owner}")


def _key(made: Cluster, permissions: list[tuple[str, str]]) -> str:
    """A new API key with exactly these (kind, pattern) permissions."""
    admin = made.fila(1).admin
    created = admin.CreateApiKey(
        admin_pb2.CreateApiKeyRequest(name=f"k-{uuid.uuid4().hex[:6]}"), timeout=RPC_TIMEOUT_S
    )
    if permissions:
        admin.SetAcl(
            admin_pb2.SetAclRequest(
                key_id=created.key_id,
                permissions=[admin_pb2.AclPermission(kind=k, pattern=p) for k, p in permissions],
            ),
            timeout=RPC_TIMEOUT_S,
        )
    return created.key


def _auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


# -- a non-reading StreamEnqueue through a node that does not own its queue ---------------

PER_REQUEST = 1_000
REQUESTS = 300
# The stream's bound (`owed_bytes_bound` at the default 10,000 messages a batch: four
# answers of 10,000 ids) in requests of 1,000 stored messages, and the one always taken.
TAKEN_BOUND = 4 * 10_000 // PER_REQUEST + 1


def test_a_stream_through_a_non_owner_that_never_reads_is_read_no_further(two: Cluster) -> None:
    """The splitter used to read without limit, and its local handler never blocked:
    RSS 117 to 315 MiB in 40 s and 5 million messages stored with no answer read. Now
    it owes what a single node's stream owes, whether its parts go to the owner or
    stay here."""
    queue = _queue_on(two, owner=2)
    fila = two.fila(1)
    entry = two.node(1)
    request = service_pb2.StreamEnqueueRequest(
        messages=[service_pb2.EnqueueRequest(queue=queue, payload=b"x")] * PER_REQUEST
    )

    def stored() -> int:
        return fila.stats(queue).depth

    before = resident_bytes_of(entry.pid)
    with RawH2Connection(entry.host, entry.port, receive_window=0).start() as client:
        client.open_call(1, STREAM_ENQUEUE, _auth(BOOT))
        sent = 0
        for sequence in range(REQUESTS):
            request.sequence_number = sequence
            if not client.send_message(1, request.SerializeToString(), within=1.0):
                break  # gRPC's read-ahead is full: the node reads no more
            sent += 1
        taken = settled(stored) // PER_REQUEST
        grown = resident_bytes_of(entry.pid) - before
        assert taken <= TAKEN_BOUND < sent, f"{taken} of {sent} requests taken, none answered"
        assert grown < 32 * MIB, f"node 1 grew {grown / MIB:.0f} MiB"

        client.grant(1, 1 << 30)

        def answered() -> int:
            client.pump(0.05)
            return len(client.answers(1))

        wait_until(lambda: answered() > 2 * TAKEN_BOUND, 30, what="the stream carrying on")
        answers = [service_pb2.StreamEnqueueResponse.FromString(a) for a in client.answers(1)]
        assert [a.sequence_number for a in answers] == list(range(len(answers)))
        assert all(len(a.results) == PER_REQUEST and a.results[0].message_id for a in answers)
