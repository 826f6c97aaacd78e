"""The answers a StreamEnqueue owes its client, in order, with a bound on how many.

A StreamEnqueue reads requests as they come and answers each once its messages are
durable, so many are in flight on one stream. Unbounded, a client that sends
requests but never reads the answers (its HTTP/2 receive window at zero) made the
broker store every request and hold every answer: measured, one such stream took
the broker from 58 to 351 MiB in 30 s, 175 MiB of it answers nobody read. With a
bound, the stream stops reading requests while it owes that many answers; HTTP/2
flow control then holds the producer back, and a disk that is slow to sync holds
back producers the same way instead of growing the broker.

The bound counts messages (and requests, for empty ones): `OWED_BATCHES_PER_STREAM`
largest batches, as many as the SDK keeps in flight on one stream for one
`enqueue_many` (`fila_sdk.batching.PIPELINE_DEPTH`), so a well-behaved client never
waits on it; one request is always taken, however large.
"""

from __future__ import annotations

import asyncio

from fila.core.broker import ItemResult

OWED_BATCHES_PER_STREAM = 4
# Empty requests are valid (`allow_empty`) and owe an answer each: bounded by count.
MAX_OWED_REQUESTS = 1024

# (sequence number, per-item results, the commit the answer waits for)
Answer = tuple[int, list[ItemResult], asyncio.Future[None]]


class OwedAnswers:
    """Owned by one StreamEnqueue: its reader `put`s, its writer `get`s."""

    __slots__ = ("_answers", "_max_messages", "_messages", "_room")

    def __init__(self, max_messages: int) -> None:
        self._answers: asyncio.Queue[Answer | None] = asyncio.Queue()
        self._max_messages = max_messages
        self._messages = 0
        self._room = asyncio.Event()  # set while the reader may take another request
        self._room.set()

    @property
    def full(self) -> bool:
        return self._messages >= self._max_messages or self._answers.qsize() >= MAX_OWED_REQUESTS

    def put(self, answer: Answer) -> None:
        self._answers.put_nowait(answer)
        self._messages += len(answer[1])
        if self.full:
            self._room.clear()

    def end(self) -> None:
        """No more requests: the writer ends after the answers before this."""
        self._answers.put_nowait(None)

    async def room(self) -> None:
        """Returns once the stream owes fewer answers than its bound, or its writer
        has ended (then nothing will drain them: the reader must see that and stop)."""
        await self._room.wait()

    async def get(self) -> Answer | None:
        answer = await self._answers.get()
        if answer is not None:
            self._messages -= len(answer[1])
            if not self.full:
                self._room.set()
        return answer

    def writer_ended(self) -> None:
        self._room.set()
