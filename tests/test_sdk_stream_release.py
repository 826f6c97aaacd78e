"""What a stopping `Worker` relies on: a StreamConsume stream that ends gives every
lease it held back to the queue at once (SPEC 1), sent or not.

Found while building the SDK: leases of messages the broker had buffered for the
stream but not yet sent stayed leased until their visibility timeout (30 s by
default) when the stream ended because the client half-closed it (the Worker's
graceful stop) or because a settlement named an unknown id (NOT_FOUND):
`read_settlements` called `consumer.close()`, which emptied the send buffer and
returned the unsent leases, and the return value was dropped. Main has since split
`close()` from `release_unsent()`; these tests keep it fixed.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import grpc.aio
import pytest

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

# Well inside the 30 s visibility timeout the leases would otherwise be held for.
PROMPT_S = 5.0


async def _stats(admin: admin_pb2_grpc.FilaAdminAsyncStub, queue: str) -> tuple[int, int]:
    stats = await admin.GetStats(admin_pb2.GetStatsRequest(queue=queue), timeout=10)
    return stats.depth, stats.in_flight


async def _until_stats(
    admin: admin_pb2_grpc.FilaAdminAsyncStub, queue: str, wanted: tuple[int, int]
) -> None:
    """Waits until (depth, in_flight) is `wanted`; fails after PROMPT_S with the last."""
    deadline = time.monotonic() + PROMPT_S
    while (seen := await _stats(admin, queue)) != wanted:
        if time.monotonic() > deadline:
            raise AssertionError(f"{queue}: (depth, in_flight) {seen}, wanted {wanted}")
        await asyncio.sleep(0.02)


async def _leased_when_settled(admin: admin_pb2_grpc.FilaAdminAsyncStub, queue: str) -> int:
    """The queue's leases once the broker has given the stream all it will (in_flight
    above 0 and the same over 0.1 s): the stream's buffer and the transport are full."""
    deadline = time.monotonic() + PROMPT_S
    last = (-1, -1)
    while (seen := await _stats(admin, queue)) != last or seen[1] == 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"{queue}: leases still changing, last {seen}")
        last = seen
        await asyncio.sleep(0.1)
    return seen[1]


def test_unsent_leases_return_when_a_settlement_names_an_unknown_id(
    server: ServerProcess,
) -> None:
    """The opening request carries an ack of an id the stream never held: the stream
    ends with NOT_FOUND right after the broker buffered ten deliveries for it."""

    async def scenario() -> None:
        async with grpc.aio.insecure_channel(server.addr) as channel:
            service = service_pb2_grpc.FilaServiceStub(channel)
            admin = admin_pb2_grpc.FilaAdminStub(channel)
            await admin.CreateQueue(admin_pb2.CreateQueueRequest(name="nf"), timeout=10)
            message = service_pb2.EnqueueRequest(queue="nf", payload=b"x")
            await service.EnqueueBatch(
                service_pb2.EnqueueBatchRequest(messages=[message] * 10), timeout=10
            )
            call = service.StreamConsume()
            opening = service_pb2.StreamConsumeRequest(
                queue="nf", prefetch=10, max_batch=10, ack_ids=[str(uuid.uuid4())]
            )
            await call.write(opening)
            with pytest.raises(grpc.RpcError) as ended:
                async for _ in call:
                    pass
            assert ended.value.code() == grpc.StatusCode.NOT_FOUND
            await _until_stats(admin, "nf", (10, 0))  # was (0, 10) for 30 s

    asyncio.run(scenario())


def test_unsent_leases_return_when_the_client_half_closes(server: ServerProcess) -> None:
    """1 MiB messages and a client that reads nothing for a moment: HTTP/2 flow control
    holds the broker's writes, so most deliveries are still in its send buffer when
    the client half-closes (as a stopping Worker does)."""

    async def scenario() -> None:
        options = [("grpc.max_receive_message_length", -1)]
        async with grpc.aio.insecure_channel(server.addr, options=options) as channel:
            service = service_pb2_grpc.FilaServiceStub(channel)
            admin = admin_pb2_grpc.FilaAdminStub(channel)
            await admin.CreateQueue(admin_pb2.CreateQueueRequest(name="hc"), timeout=10)
            for _ in range(12):
                request = service_pb2.EnqueueRequest(queue="hc", payload=b"x" * (1 << 20))
                await service.Enqueue(request, timeout=10)
            call = service.StreamConsume()
            await call.write(service_pb2.StreamConsumeRequest(queue="hc", prefetch=12))
            leased = await _leased_when_settled(admin, "hc")
            await call.done_writing()
            received = 0
            async for frame in call:
                received += frame.HasField("message")
            assert received < leased, "no lease was unsent at the half-close: nothing tested"
            # every delivered message came back as a failed attempt, and so must the rest
            await _until_stats(admin, "hc", (12, 0))  # was (4, 8), 4 received

    asyncio.run(scenario())
