"""`fila.v1.FilaService`: the hot path, as thin adapters over the broker.

Registered through a generic handler rather than the generated servicer so
that `Consume` can send frames the broker already encoded (identity
serializer) instead of re-serializing every message.
"""

from __future__ import annotations

from typing import Any

import grpc

from fila.core.broker import Broker, EnqueueItem
from fila.core.errors import BrokerError
from fila.core.frames import KEEPALIVE_FRAME
from fila.server.status import abort, unary_errors
from fila.v1 import service_pb2

SERVICE_NAME = "fila.v1.FilaService"
Context = grpc.aio.ServicerContext[Any, Any]


class FilaService:
    def __init__(self, broker: Broker) -> None:
        self._broker = broker

    @unary_errors
    async def enqueue(
        self, request: service_pb2.EnqueueRequest, context: Context
    ) -> service_pb2.EnqueueResponse:
        ids, committed = self._broker.enqueue(
            request.queue, [EnqueueItem(request.headers, request.payload)]
        )
        await committed
        return service_pb2.EnqueueResponse(message_id=ids[0])

    async def consume(self, request: service_pb2.ConsumeRequest, context: Context) -> None:
        broker = self._broker
        keepalive_s = broker.settings.keepalive_s
        try:
            consumer = broker.attach_consumer(request.queue)
        except BrokerError as exc:
            await abort(context, exc)
        try:
            while True:
                item = consumer.take()
                if item is None:
                    if not await consumer.wait(keepalive_s):
                        await context.write(KEEPALIVE_FRAME)
                    continue
                lease, frame = item
                if broker.consumer_took(lease):
                    await context.write(frame)
        except BrokerError as exc:
            await abort(context, exc)
        finally:
            broker.detach_consumer(consumer)

    @unary_errors
    async def ack(
        self, request: service_pb2.AckRequest, context: Context
    ) -> service_pb2.AckResponse:
        await self._broker.ack(request.queue, request.message_id)
        return service_pb2.AckResponse()

    @unary_errors
    async def nack(
        self, request: service_pb2.NackRequest, context: Context
    ) -> service_pb2.NackResponse:
        await self._broker.nack(request.queue, request.message_id, request.error)
        return service_pb2.NackResponse()

    def generic_handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        def identity(frame: bytes) -> bytes:
            return frame

        handlers = {
            "Enqueue": grpc.unary_unary_rpc_method_handler(
                self.enqueue,
                request_deserializer=service_pb2.EnqueueRequest.FromString,
                response_serializer=service_pb2.EnqueueResponse.SerializeToString,
            ),
            "Consume": grpc.unary_stream_rpc_method_handler(
                self.consume,
                request_deserializer=service_pb2.ConsumeRequest.FromString,
                response_serializer=identity,
            ),
            "Ack": grpc.unary_unary_rpc_method_handler(
                self.ack,
                request_deserializer=service_pb2.AckRequest.FromString,
                response_serializer=service_pb2.AckResponse.SerializeToString,
            ),
            "Nack": grpc.unary_unary_rpc_method_handler(
                self.nack,
                request_deserializer=service_pb2.NackRequest.FromString,
                response_serializer=service_pb2.NackResponse.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
