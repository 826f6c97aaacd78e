"""A StreamEnqueue whose client does not read its answers stops reading requests
(`fila.server.owed`), and carries on in order once the answers drain."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import pytest
from support.core import make_core

from fila.config import parse_config
from fila.core.errors import BrokerError
from fila.server.owed import ANSWER_OVERHEAD_BYTES, owed_bytes_bound
from fila.server.results import stream_answer
from fila.server.service import FilaService
from fila.v1 import service_pb2

MAX_BATCH = 100
PER_REQUEST = 10


def _taken_while_shut(answer_bytes: list[int]) -> int:
    """How many requests a stream takes before the bytes of the answers it owes (none
    written: the client's window is shut) reach its bound; one is always taken."""
    bound, owed = owed_bytes_bound(MAX_BATCH), 0
    for taken, size in enumerate(answer_bytes, 1):
        owed += size + ANSWER_OVERHEAD_BYTES
        if owed >= bound:
            return taken
    raise AssertionError("the bound is never reached")


ID = "0" * 36  # a message id's length: stored items' answers are this size
READ_WHILE_SHUT = _taken_while_shut(
    [len(stream_answer(n, [ID] * PER_REQUEST)) for n in range(10_000)]
)


class _Client:
    """The client's side of one StreamEnqueue: requests on demand, and a receive
    window that is shut until `read()` opens it (its `write` is the broker's)."""

    def __init__(self, count: int, queue: str = "q") -> None:
        self.count = count
        self.queue = queue
        self.taken = 0
        self.answered: list[int] = []
        self.results: list[service_pb2.EnqueueResult] = []
        self.window_open = asyncio.Event()
        self.gone: BaseException | None = None

    async def requests(self) -> AsyncIterator[service_pb2.StreamEnqueueRequest]:
        for sequence in range(self.count):
            self.taken += 1
            messages = [
                service_pb2.EnqueueRequest(queue=self.queue, payload=b"p")
                for _ in range(PER_REQUEST)
            ]
            yield service_pb2.StreamEnqueueRequest(sequence_number=sequence, messages=messages)

    async def write(self, frame: bytes) -> None:
        await self.window_open.wait()
        if self.gone is not None:
            raise self.gone
        answer = service_pb2.StreamEnqueueResponse.FromString(frame)
        self.answered.append(answer.sequence_number)
        self.results += answer.results


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


def test_failed_items_are_owed_as_their_answer_bytes_not_as_their_errors() -> None:
    """Each failed item used to be held as its exception, traceback and all, until its
    answer was written: 9-14 MiB per non-reading stream of 10,000-item requests. Now an
    answer is kept as its encoded bytes and the bound counts them: a failed item's
    answer is larger than a stored one's, so fewer requests are taken."""

    async def scenario() -> None:
        client = _Client(count=10 * READ_WHILE_SHUT, queue="nope")
        stream = asyncio.create_task(_service().stream_enqueue(client.requests(), client))  # type: ignore[arg-type]
        gc.collect()
        gc.disable()  # what a cycle would keep stays visible: found, not collected
        try:
            await _turns(20 * client.count)
            errors = [o for o in gc.get_objects() if isinstance(o, BrokerError)]
        finally:
            gc.enable()
        assert errors == [], "no failed item's exception is held while its answer is owed"
        failed = service_pb2.StreamEnqueueResponse(
            sequence_number=1,
            results=[
                service_pb2.EnqueueResult(
                    error=service_pb2.BatchError(
                        code=5, kind="queue_not_found", message='queue "nope" not found'
                    )
                )
            ]
            * PER_REQUEST,
        ).ByteSize()
        assert client.taken == _taken_while_shut([failed] * client.count) < READ_WHILE_SHUT

        client.window_open.set()
        await asyncio.wait_for(stream, timeout=10)
        assert client.answered == list(range(client.count)), "every answer, in order"
        assert {r.error.kind for r in client.results} == {"queue_not_found"}
        assert len(client.results) == client.count * PER_REQUEST

    asyncio.run(scenario())
