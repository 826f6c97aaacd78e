"""The few calls the CLI makes below `fila_sdk.Client`'s public methods.

They run on the client's own channel, with its credentials, API key and error
mapping, so they behave exactly like the SDK's calls; this module is the only
place in the CLI that reaches into the client:
- the standard health check (`grpc.health.v1` is not part of `fila.v1`, so the
  SDK has no method for it): the connection probe and `fila health`;
- an enqueue with `EnqueueRequest.delay_ms` (`fila enqueue --delay`), without
  depending on the shape the SDK's own `enqueue` takes for delays;
- a Consume stream with `prefetch=1` (`fila tail --ack`), so that a tail stopped
  with Ctrl-C holds at most the one message it was printing;
- cluster mode (SPEC 9): `ClusterStatus`, `RemoveNode`, and where each queue lives
  (its node, and for a replicated queue its replicas and in-sync set, which the
  SDK's records leave out) for `queue list` and `queue inspect`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fila.v1 import admin_pb2, service_pb2
from fila_sdk import Client, Message, QueueInfo, QueueStats
from fila_sdk._channel import map_rpc_error

SERVING = health_pb2.HealthCheckResponse.SERVING


def status_name(status: int) -> str:
    """`1` -> `SERVING`: the health status as grpc.health.v1 spells it."""
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    return name


def health(client: Client, service: str, timeout: float) -> int:
    """The broker's `grpc.health.v1` status for `service` ("" = the whole broker).

    Fails at once (instead of waiting for the deadline) when the first connection
    attempt fails, so an unreachable broker is reported without delay.
    """
    check = health_pb2_grpc.HealthStub(client._channel).Check
    try:
        reply = check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=timeout,
            metadata=client._settings.metadata,
            wait_for_ready=False,
        )
    except grpc.RpcError as err:
        raise map_rpc_error(err, "Check") from err
    return int(reply.status)


def enqueue(
    client: Client, queue: str, headers: Mapping[str, str], payload: bytes, delay_ms: int
) -> str:
    request = service_pb2.EnqueueRequest(
        queue=queue, headers=headers, payload=payload, delay_ms=delay_ms
    )
    return client._unary(client._service.Enqueue, request).message_id


def consume(client: Client, queue: str, prefetch: int) -> Generator[Message, None, None]:
    """Messages leased on one Consume stream holding at most `prefetch` unacked."""
    request = service_pb2.ConsumeRequest(queue=queue, prefetch=prefetch)
    call = client._service.Consume(request, metadata=client._settings.metadata)
    try:
        for response in call:
            if response.HasField("message"):  # skip keepalive frames
                yield Message.from_proto(response.message)
    except grpc.RpcError as err:
        raise map_rpc_error(err, "Consume") from err
    finally:
        call.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves it untyped


@dataclass(frozen=True, slots=True)
class Place:
    """Where a queue lives: its node (its leader; 0 on a single node) and, when it is
    replicated, its replicas (leader first) and in-sync set."""

    node: int = 0
    replicas: tuple[int, ...] = ()
    in_sync: tuple[int, ...] = ()

    @property
    def replicated(self) -> bool:
        return len(self.replicas) > 1

    @classmethod
    def of(cls, node: int, replicas: Sequence[int], in_sync: Sequence[int]) -> Place:
        return cls(int(node), tuple(int(n) for n in replicas), tuple(int(n) for n in in_sync))


def queues(client: Client) -> tuple[list[QueueInfo], dict[str, Place]]:
    """ListQueues: the queues, and where each lives."""
    reply = client._unary(client._admin.ListQueues, admin_pb2.ListQueuesRequest())
    places = {
        q.name: Place.of(q.leader_node_id, q.replica_node_ids, q.in_sync_node_ids)
        for q in reply.queues
    }
    return [QueueInfo.from_proto(q) for q in reply.queues], places


def stats(client: Client, queue: str) -> tuple[QueueStats, Place]:
    """GetStats: the queue's stats, and where it lives."""
    reply = client._unary(client._admin.GetStats, admin_pb2.GetStatsRequest(queue=queue))
    place = Place.of(reply.leader_node_id, reply.replica_node_ids, reply.in_sync_node_ids)
    return QueueStats.from_proto(reply), place


def cluster_status(client: Client) -> admin_pb2.ClusterStatusResponse:
    return client._unary(client._admin.ClusterStatus, admin_pb2.ClusterStatusRequest())


def remove_node(client: Client, node_id: int, discard: bool) -> admin_pb2.RemoveNodeResponse:
    request = admin_pb2.RemoveNodeRequest(node_id=node_id, discard_lost_queues=discard)
    return client._unary(client._admin.RemoveNode, request)
