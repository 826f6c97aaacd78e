"""A StreamEnqueue whose client does not read its answers stops reading requests
(`fila.server.owed`), and carries on in order once the answers drain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from support.core import make_core

from fila.config import parse_config
from fila.server.owed import OWED_BATCHES_PER_STREAM
from fila.server.service import FilaService
from fila.v1 import service_pb2

MAX_BATCH = 100
PER_REQUEST = 10
# the answers queued, and the one the writer holds while the client's window is shut
READ_WHILE_SHUT = OWED_BATCHES_PER_STREAM * MAX_BATCH // PER_REQUEST + 1


class _Client:
    """The client's side of one StreamEnqueue: requests on demand, and a receive
    window that is shut until `read()` opens it (its `write` is the broker's)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.taken = 0
        self.answered: list[int] = []
        self.window_open = asyncio.Event()
        self.gone: BaseException | None = None

    async def requests(self) -> AsyncIterator[service_pb2.StreamEnqueueRequest]:
        for sequence in range(self.count):
            self.taken += 1
            messages = [
                service_pb2.EnqueueRequest(queue="q", payload=b"p") for _ in range(PER_REQUEST)
            ]
            yield service_pb2.StreamEnqueueRequest(sequence_number=sequence, messages=messages)

    async def write(self, frame: bytes) -> None:
        await self.window_open.wait()
        if self.gone is not None:
            raise self.gone
        self.answered.append(service_pb2.StreamEnqueueResponse.FromString(frame).sequence_number)


async def _turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


def _service() -> FilaService:
    config = parse_config(f"[server]\nmax_batch_messages = {MAX_BATCH}\n", "test")
    return FilaService(make_core(queues=["q"], config=config).broker)


def test_a_client_that_reads_no_answers_is_read_no_further_until_it_does() -> None:
    async def scenario() -> None:
        client = _Client(count=10 * READ_WHILE_SHUT)
        stream = asyncio.create_task(_service().stream_enqueue(client.requests(), client))  # type: ignore[arg-type]
        await _turns(20 * client.count)  # far more turns than the requests need
        assert client.taken == READ_WHILE_SHUT, "read up to the bound of answers owed"

        client.window_open.set()
        await asyncio.wait_for(stream, timeout=10)
        assert client.taken == client.count
        assert client.answered == list(range(client.count)), "every answer, in order"

    asyncio.run(scenario())


def test_a_client_that_goes_away_while_the_stream_waits_for_room_ends_it() -> None:
    async def scenario() -> None:
        client = _Client(count=10 * READ_WHILE_SHUT)
        stream = asyncio.create_task(_service().stream_enqueue(client.requests(), client))  # type: ignore[arg-type]
        await _turns(20 * client.count)
        assert client.taken == READ_WHILE_SHUT
        client.gone = ConnectionResetError("the client went away")
        client.window_open.set()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(stream, timeout=10)
        assert client.taken == READ_WHILE_SHUT, "nothing read after the writer failed"

    asyncio.run(scenario())
