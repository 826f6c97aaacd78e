"""How cluster routing fails, as typed errors the edge maps to statuses in one place
(`fila.server.status`); and `Misconfigured`, how a node's start is refused for its
configuration (exit code 2, mapped in `fila.server.main`).

All but `RemoteError` are UNAVAILABLE: the call could succeed later or elsewhere
(the owner returns, the lease is renewed, the client connects to the owner).
"""

from __future__ import annotations

import grpc

from fila.core.errors import BrokerError, Unavailable, clip
from fila.wire import ErrorKind


class Misconfigured(BrokerError):
    """Startup refused because of this node's configuration, which only the operator
    can change: `fila-server` exits with code 2 (not 1), so that a supervisor does not
    restart the node into the same refusal."""


class Fenced(Unavailable):
    """This node's etcd lease lapsed: its queues are unavailable until it has one."""


class OwnerDown(Unavailable):
    """The queue's owner is not a live member of the cluster (or does not answer)."""

    def __init__(self, queue: str, node_id: int) -> None:
        super().__init__(f'queue "{clip(queue)}" is on node {node_id}, which is down')
        self.node_id = node_id


class NotOwner(Unavailable):
    """A forwarded call reached a node that does not own its queue (placement changed
    meanwhile, or views disagree): answered, never forwarded again, so no call loops."""

    def __init__(self, queue: str, node_id: int, owner: int | None) -> None:
        where = "no node" if owner is None else f"node {owner}"
        super().__init__(
            f'a call forwarded to node {node_id} for queue "{clip(queue)}", which this node '
            f"places on {where}; not forwarded again (retry)"
        )


class Redirect(Unavailable):
    """Consume and StreamConsume are served by the queue's owner only: the client is
    told where (trailing `x-fila-leader-addr`, SPEC 9), and the published clients
    reconnect there."""

    def __init__(self, queue: str, node_id: int, leader_addr: str) -> None:
        super().__init__(
            f'queue "{clip(queue)}" is served by node {node_id} at {leader_addr}: consume there'
        )
        self.leader_addr = leader_addr


class RemoteError(BrokerError):
    """The owner's answer to a forwarded call, passed on as the owner gave it: its
    status code, message and error kind (None when the owner's transport, not the
    broker, failed the call: no `x-fila-error-kind`)."""

    def __init__(self, code: grpc.StatusCode, kind: str | None, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.kind_value = kind
        if kind is not None and kind in ErrorKind._value2member_map_:
            self.kind = ErrorKind(kind)


class NoLeader(Unavailable):
    """A replicated queue's leader is gone and no in-sync replica can take over: the
    queue waits for one (no unclean election, SPEC 9)."""

    def __init__(self, queue: str, waiting_for: tuple[int, ...]) -> None:
        nodes = ", ".join(str(n) for n in waiting_for) or "none"
        super().__init__(
            f'queue "{clip(queue)}" has no leader: waiting for an in-sync replica to come '
            f"back (nodes {nodes})"
        )
        self.waiting_for = waiting_for


class LeaderChanged(Unavailable):
    """This node lost the lead of a replicated queue while a call waited: its outcome
    is unknown (retry; the new leader answers)."""

    def __init__(self, queue: str) -> None:
        super().__init__(
            f'this node no longer leads queue "{clip(queue)}": the outcome is unknown, retry'
        )


class TakingOver(Unavailable):
    """This node was elected to lead a replicated queue and is not serving it yet."""

    def __init__(self, queue: str, node_id: int) -> None:
        super().__init__(f'node {node_id} is taking over queue "{clip(queue)}": retry')
