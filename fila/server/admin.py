"""`fila.v1.FilaAdmin`: queue admin, runtime config, redrive, stats, peek, purge, API keys
and ACLs (kept by `fila.security.keyring.Keyring`).

Registered like the hot path (see `fila.server.rpc`), so an undecodable request
gets INVALID_ARGUMENT here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from fila.core import retry
from fila.core.administration import UPDATABLE
from fila.core.broker import Broker
from fila.core.errors import InvalidArgument, Unimplemented, clip
from fila.core.queue import QueueRecord
from fila.security.keyring import Keyring
from fila.server import access, rpc
from fila.server.rpc import Context
from fila.v1 import admin_pb2
from fila.wire import dlq_owner

SERVICE_NAME = "fila.v1.FilaAdmin"


def queue_config(record: QueueRecord) -> admin_pb2.QueueConfig:
    """A queue's configuration as GetQueue and UpdateQueue answer it: every value in
    force (defaults resolved; no attempt limit is `max_attempts` 2^32-1)."""
    return admin_pb2.QueueConfig(
        on_enqueue_script=record.on_enqueue_script,
        on_failure_script=record.on_failure_script,
        visibility_timeout_ms=record.visibility_timeout_ms,
        max_attempts=retry.wire_max_attempts(record.max_attempts),
        retry_backoff=record.retry_backoff,
    )


def config_changes(
    config: admin_pb2.QueueConfig, update_mask: Sequence[str]
) -> dict[str, str | int]:
    """The fields an UpdateQueue names (`config.x` or `x`), with their values; an
    empty mask names every field `config` sets (scripts are cleared only by name)."""
    names = [path.removeprefix("config.") for path in update_mask]
    if not names:
        names = [field.name for field, _ in config.ListFields()]
    changes: dict[str, str | int] = {}
    for name in names:
        if name not in UPDATABLE:
            raise InvalidArgument(
                f'update_mask names "{clip(name)}"; the fields are {", ".join(UPDATABLE)}'
            )
        changes[name] = getattr(config, name)
    return changes


class FilaAdmin:
    def __init__(self, broker: Broker, keyring: Keyring) -> None:
        self._broker = broker
        self._keyring = keyring

    async def create_queue(
        self, request: admin_pb2.CreateQueueRequest, context: Context
    ) -> admin_pb2.CreateQueueResponse:
        config = request.config
        await self._broker.create_queue(
            request.name,
            config.on_enqueue_script,
            config.on_failure_script,
            config.visibility_timeout_ms,
            max_attempts=config.max_attempts,
            retry_backoff=config.retry_backoff,
        )
        return admin_pb2.CreateQueueResponse(queue_id=request.name)

    async def get_queue(
        self, request: admin_pb2.GetQueueRequest, context: Context
    ) -> admin_pb2.GetQueueResponse:
        queue = self._broker.get_queue(request.queue)
        return admin_pb2.GetQueueResponse(
            name=queue.name, config=queue_config(queue.record), dlq=queue.dlq_name or ""
        )

    async def update_queue(
        self, request: admin_pb2.UpdateQueueRequest, context: Context
    ) -> admin_pb2.UpdateQueueResponse:
        record, committed = self._broker.update_queue(
            request.queue, config_changes(request.config, request.update_mask)
        )
        await committed
        return admin_pb2.UpdateQueueResponse(config=queue_config(record))

    async def delete_queue(
        self, request: admin_pb2.DeleteQueueRequest, context: Context
    ) -> admin_pb2.DeleteQueueResponse:
        await self._broker.delete_queue(request.queue)
        return admin_pb2.DeleteQueueResponse()

    async def list_queues(
        self, request: admin_pb2.ListQueuesRequest, context: Context
    ) -> admin_pb2.ListQueuesResponse:
        infos = [
            admin_pb2.QueueInfo(
                name=queue.name,
                depth=queue.depth,
                in_flight=len(queue.leases),
                active_consumers=len(queue.consumers),
            )
            for queue in self._broker.list_queues()
            if access.may_see(queue.name)
        ]
        return admin_pb2.ListQueuesResponse(queues=infos, cluster_node_count=1)

    async def get_stats(
        self, request: admin_pb2.GetStatsRequest, context: Context
    ) -> admin_pb2.GetStatsResponse:
        stats = await self._broker.stats_in_turns(request.queue)
        counters = stats.counters
        response = admin_pb2.GetStatsResponse(
            depth=stats.depth,
            in_flight=stats.in_flight,
            active_fairness_keys=stats.active_fairness_keys,
            active_consumers=stats.active_consumers,
            quantum=stats.quantum,
            per_key_stats=[
                admin_pb2.PerFairnessKeyStats(
                    key=k.key,
                    pending_count=k.pending,
                    current_deficit=k.deficit,
                    weight=k.weight,
                    delivered_total=k.delivered,
                )
                for k in stats.per_key
            ],
            per_throttle_stats=[
                admin_pb2.PerThrottleKeyStats(
                    key=t.key, tokens=t.tokens, rate_per_second=t.rate_per_second, burst=t.burst
                )
                for t in stats.per_throttle
            ],
            enqueued_total=counters.enqueued,
            delivered_total=counters.delivered,
            acked_total=counters.acked,
            nacked_total=counters.nacked,
            expired_total=counters.expired,
            dead_lettered_total=counters.dead_lettered,
            delayed=stats.delayed,
            hook_errors_total=stats.hook_errors_total,
            last_hook_error=stats.last_hook_error,
        )
        if stats.last_hook_error_at_ms:
            response.last_hook_error_at.FromMilliseconds(stats.last_hook_error_at_ms)
        return response

    async def set_config(
        self, request: admin_pb2.SetConfigRequest, context: Context
    ) -> admin_pb2.SetConfigResponse:
        await self._broker.set_config(request.key, request.value)
        return admin_pb2.SetConfigResponse()

    async def get_config(
        self, request: admin_pb2.GetConfigRequest, context: Context
    ) -> admin_pb2.GetConfigResponse:
        return admin_pb2.GetConfigResponse(value=self._broker.get_config(request.key))

    async def list_config(
        self, request: admin_pb2.ListConfigRequest, context: Context
    ) -> admin_pb2.ListConfigResponse:
        entries, total = self._broker.list_config(request.prefix)
        return admin_pb2.ListConfigResponse(
            entries=[admin_pb2.ConfigEntry(key=k, value=v) for k, v in entries],
            total_count=total,
        )

    async def redrive(
        self, request: admin_pb2.RedriveRequest, context: Context
    ) -> admin_pb2.RedriveResponse:
        dlq = request.dlq_queue
        source = dlq_owner(dlq)
        if source is not None:  # redrive writes into the source queue: admin there too
            access.require(access.Kind.ADMIN, source)
        count = await self._broker.redrive(dlq, request.count)
        return admin_pb2.RedriveResponse(redriven=count)

    async def peek_messages(
        self, request: admin_pb2.PeekMessagesRequest, context: Context
    ) -> admin_pb2.PeekMessagesResponse:
        messages, states, next_after = await self._broker.peek_states(
            request.queue, request.limit, request.after_id, request.fairness_key, request.state
        )
        response = admin_pb2.PeekMessagesResponse(messages=messages, next_after_id=next_after)
        for peeked in states:
            entry = response.states.add(state=int(peeked.state))
            if peeked.ready_at_ms:
                entry.ready_at.FromMilliseconds(peeked.ready_at_ms)
            if peeked.lease_deadline_ms:
                entry.lease_deadline.FromMilliseconds(peeked.lease_deadline_ms)
        return response

    async def purge_queue(
        self, request: admin_pb2.PurgeQueueRequest, context: Context
    ) -> admin_pb2.PurgeQueueResponse:
        count, committed = self._broker.purge(request.queue)
        await committed
        return admin_pb2.PurgeQueueResponse(purged=count)

    async def create_api_key(
        self, request: admin_pb2.CreateApiKeyRequest, context: Context
    ) -> admin_pb2.CreateApiKeyResponse:
        record, key, committed = self._keyring.create(
            access.current(), request.name, request.expires_at_ms, request.is_superadmin
        )
        await committed
        return admin_pb2.CreateApiKeyResponse(
            key_id=record.key_id, key=key, is_superadmin=record.is_superadmin
        )

    async def revoke_api_key(
        self, request: admin_pb2.RevokeApiKeyRequest, context: Context
    ) -> admin_pb2.RevokeApiKeyResponse:
        await self._keyring.revoke(access.current(), request.key_id)
        return admin_pb2.RevokeApiKeyResponse()

    async def list_api_keys(
        self, request: admin_pb2.ListApiKeysRequest, context: Context
    ) -> admin_pb2.ListApiKeysResponse:
        return admin_pb2.ListApiKeysResponse(
            keys=[
                admin_pb2.ApiKeyInfo(
                    key_id=r.key_id,
                    name=r.name,
                    created_at_ms=r.created_at_ms,
                    expires_at_ms=r.expires_at_ms,
                    is_superadmin=r.is_superadmin,
                )
                for r in self._keyring.list_keys(access.current())
            ]
        )

    async def set_acl(
        self, request: admin_pb2.SetAclRequest, context: Context
    ) -> admin_pb2.SetAclResponse:
        pairs = [(p.kind, p.pattern) for p in request.permissions]
        await self._keyring.set_acl(access.current(), request.key_id, pairs)
        return admin_pb2.SetAclResponse()

    async def get_acl(
        self, request: admin_pb2.GetAclRequest, context: Context
    ) -> admin_pb2.GetAclResponse:
        record, permissions = self._keyring.get_acl(access.current(), request.key_id)
        return admin_pb2.GetAclResponse(
            key_id=record.key_id,
            permissions=[
                admin_pb2.AclPermission(kind=p.kind.value, pattern=p.pattern.text)
                for p in permissions
            ],
            is_superadmin=record.is_superadmin,
        )

    async def cluster_status(
        self, request: admin_pb2.ClusterStatusRequest, context: Context
    ) -> admin_pb2.ClusterStatusResponse:
        """A single node is not in cluster mode; cluster mode answers this itself
        (`fila.cluster.edge`)."""
        return admin_pb2.ClusterStatusResponse(enabled=False)

    async def remove_node(
        self, request: admin_pb2.RemoveNodeRequest, context: Context
    ) -> admin_pb2.RemoveNodeResponse:
        """Cluster mode answers this itself (`fila.cluster.edge`); a single node has no
        other node to remove."""
        raise Unimplemented(
            "RemoveNode is a cluster call (SPEC 9): this broker runs as a single node"
        )

    def generic_handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        a = admin_pb2
        table: dict[str, tuple[Any, Any]] = {
            "CreateQueue": (a.CreateQueueRequest, self.create_queue),
            "DeleteQueue": (a.DeleteQueueRequest, self.delete_queue),
            "ListQueues": (a.ListQueuesRequest, self.list_queues),
            "GetStats": (a.GetStatsRequest, self.get_stats),
            "SetConfig": (a.SetConfigRequest, self.set_config),
            "GetConfig": (a.GetConfigRequest, self.get_config),
            "ListConfig": (a.ListConfigRequest, self.list_config),
            "Redrive": (a.RedriveRequest, self.redrive),
            "PeekMessages": (a.PeekMessagesRequest, self.peek_messages),
            "PurgeQueue": (a.PurgeQueueRequest, self.purge_queue),
            "CreateApiKey": (a.CreateApiKeyRequest, self.create_api_key),
            "RevokeApiKey": (a.RevokeApiKeyRequest, self.revoke_api_key),
            "ListApiKeys": (a.ListApiKeysRequest, self.list_api_keys),
            "SetAcl": (a.SetAclRequest, self.set_acl),
            "GetAcl": (a.GetAclRequest, self.get_acl),
            "ClusterStatus": (a.ClusterStatusRequest, self.cluster_status),
            "GetQueue": (a.GetQueueRequest, self.get_queue),
            "UpdateQueue": (a.UpdateQueueRequest, self.update_queue),
            "RemoveNode": (a.RemoveNodeRequest, self.remove_node),
        }
        handlers = {name: rpc.unary(name, cls, fn) for name, (cls, fn) in table.items()}
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
