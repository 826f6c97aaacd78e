"""A client that vanishes mid-stream leaves no error with a traceback in the log: the
write that failed because its call had ended is the client's leaving, not a fault."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support.core import make_core

from fila.server import rpc
from fila.server.service import FilaService
from fila.v1 import service_pb2


class _EndedCall:
    """A servicer context whose call already ended: its client went away."""

    def __init__(self, done: bool) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done

    async def write(self, frame: bytes) -> None:
        raise RuntimeError("the call is over")  # as grpc's ExecuteBatchError would


@pytest.mark.parametrize("done", [True, False])
def test_a_stream_whose_write_fails_after_its_call_ended_ends_quietly(done: bool) -> None:
    async def behaviour(request: Any, context: Any) -> None:
        await context.write(b"frame")

    handler: Any = rpc.server_stream("Consume", service_pb2.ConsumeRequest, behaviour)

    async def call() -> None:
        await handler.unary_stream(service_pb2.ConsumeRequest(queue="q"), _EndedCall(done))

    if done:
        asyncio.run(call())  # nothing raised: gRPC would have logged it as an error
    else:
        with pytest.raises(RuntimeError):  # a live call's failure is still an error
            asyncio.run(call())


def test_a_stream_enqueue_cancelled_after_its_answer_failed_leaves_no_unretrieved_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> None:
        service = FilaService(make_core(queues=["q"]).broker)
        written = asyncio.Event()
        more = asyncio.Event()

        async def requests() -> AsyncIterator[service_pb2.StreamEnqueueRequest]:
            messages = [service_pb2.EnqueueRequest(queue="q", payload=b"p")]
            yield service_pb2.StreamEnqueueRequest(sequence_number=1, messages=messages)
            await more.wait()  # the client sends nothing more

        class Gone:
            async def write(self, frame: bytes) -> None:
                written.set()
                raise ConnectionResetError("the client went away")

        stream = asyncio.create_task(service.stream_enqueue(requests(), Gone()))  # type: ignore[arg-type]
        await asyncio.wait_for(written.wait(), 5)  # the writer has failed and ended
        stream.cancel()  # what gRPC does to the handler of a call whose client left
        with pytest.raises(asyncio.CancelledError):
            await stream

    caplog.set_level(logging.ERROR, logger="asyncio")
    asyncio.run(scenario())
    gc.collect()
    assert "exception was never retrieved" not in caplog.text
