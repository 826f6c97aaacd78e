"""`fila.v1.FilaAdmin`: queue admin, runtime config, redrive, stats."""

from __future__ import annotations

from typing import Any

import grpc

from fila.core.broker import Broker
from fila.core.errors import Unimplemented
from fila.server.status import unary_errors
from fila.v1 import admin_pb2, admin_pb2_grpc

Context = grpc.aio.ServicerContext[Any, Any]


class FilaAdmin(admin_pb2_grpc.FilaAdminServicer):
    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    @unary_errors
    async def CreateQueue(
        self, request: admin_pb2.CreateQueueRequest, context: Context
    ) -> admin_pb2.CreateQueueResponse:
        config = request.config
        await self._broker.create_queue(
            request.name,
            config.on_enqueue_script,
            config.on_failure_script,
            config.visibility_timeout_ms,
        )
        return admin_pb2.CreateQueueResponse(queue_id=request.name)

    @unary_errors
    async def DeleteQueue(
        self, request: admin_pb2.DeleteQueueRequest, context: Context
    ) -> admin_pb2.DeleteQueueResponse:
        await self._broker.delete_queue(request.queue)
        return admin_pb2.DeleteQueueResponse()

    @unary_errors
    async def ListQueues(
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
        ]
        return admin_pb2.ListQueuesResponse(queues=infos, cluster_node_count=1)

    @unary_errors
    async def GetStats(
        self, request: admin_pb2.GetStatsRequest, context: Context
    ) -> admin_pb2.GetStatsResponse:
        stats = self._broker.stats(request.queue)
        return admin_pb2.GetStatsResponse(
            depth=stats.depth,
            in_flight=stats.in_flight,
            active_fairness_keys=stats.active_fairness_keys,
            active_consumers=stats.active_consumers,
            quantum=stats.quantum,
            per_key_stats=[
                admin_pb2.PerFairnessKeyStats(
                    key=k.key, pending_count=k.pending, current_deficit=k.deficit, weight=k.weight
                )
                for k in stats.per_key
            ],
            per_throttle_stats=[
                admin_pb2.PerThrottleKeyStats(
                    key=t.key, tokens=t.tokens, rate_per_second=t.rate_per_second, burst=t.burst
                )
                for t in stats.per_throttle
            ],
        )

    @unary_errors
    async def SetConfig(
        self, request: admin_pb2.SetConfigRequest, context: Context
    ) -> admin_pb2.SetConfigResponse:
        await self._broker.set_config(request.key, request.value)
        return admin_pb2.SetConfigResponse()

    @unary_errors
    async def GetConfig(
        self, request: admin_pb2.GetConfigRequest, context: Context
    ) -> admin_pb2.GetConfigResponse:
        return admin_pb2.GetConfigResponse(value=self._broker.get_config(request.key))

    @unary_errors
    async def ListConfig(
        self, request: admin_pb2.ListConfigRequest, context: Context
    ) -> admin_pb2.ListConfigResponse:
        entries = self._broker.list_config(request.prefix)
        return admin_pb2.ListConfigResponse(
            entries=[admin_pb2.ConfigEntry(key=k, value=v) for k, v in entries],
            total_count=len(entries),
        )

    @unary_errors
    async def Redrive(
        self, request: admin_pb2.RedriveRequest, context: Context
    ) -> admin_pb2.RedriveResponse:
        count, committed = self._broker.redrive(request.dlq_queue, request.count)
        await committed
        return admin_pb2.RedriveResponse(redriven=count)

    @unary_errors
    async def CreateApiKey(self, request: Any, context: Context) -> Any:
        raise _security_pending()

    @unary_errors
    async def RevokeApiKey(self, request: Any, context: Context) -> Any:
        raise _security_pending()

    @unary_errors
    async def ListApiKeys(self, request: Any, context: Context) -> Any:
        raise _security_pending()

    @unary_errors
    async def SetAcl(self, request: Any, context: Context) -> Any:
        raise _security_pending()

    @unary_errors
    async def GetAcl(self, request: Any, context: Context) -> Any:
        raise _security_pending()


def _security_pending() -> Unimplemented:
    return Unimplemented("API keys and ACLs are not available in this release")
