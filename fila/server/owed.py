"""The answers a StreamEnqueue owes its client, in order, with a bound in bytes.

A StreamEnqueue reads requests as they come and answers each once its messages are
durable, so many are in flight on one stream. Unbounded, a client that sends
requests but never reads the answers (its HTTP/2 receive window at zero) made the
broker store every request and hold every answer. With a bound, the stream stops
reading requests while the answers it owes (taken, not yet written to gRPC) reach
it; HTTP/2 flow control then holds the producer back, and a disk that is slow to
sync holds back producers the same way instead of growing the broker.

The bound is in bytes of encoded answers (`fila.server.results`: an answer is kept
as its bytes, never as the objects it was built from), plus `ANSWER_OVERHEAD_BYTES`
per answer for what holds it. It fits `OWED_BATCHES_PER_STREAM` answers to the
largest batches (`server.max_batch_messages` stored messages each), as many as the
SDK keeps in flight on one stream for one `enqueue_many`
(`fila_sdk.batching.PIPELINE_DEPTH`), so a well-behaved client never waits on it.
Failed items cost more bytes each than stored ones (a `BatchError` with its
message), so fewer such answers are owed at once. One request is always taken,
however large its answer: a stream's memory is its bound plus one answer.

The splitter of cluster mode (`fila.cluster.streams`) holds the same bound for the
requests it splits, whether their parts are served here or forwarded.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

from fila.server.results import ID_RESULT_BYTES

OWED_BATCHES_PER_STREAM = 4
# A held answer's tuple, its commit future and its bytes object's header, rounded up.
ANSWER_OVERHEAD_BYTES = 256

T = TypeVar("T")


def owed_bytes_bound(max_batch_messages: int) -> int:
    """The bound of one stream (see the module docstring)."""
    answer = max_batch_messages * ID_RESULT_BYTES + ANSWER_OVERHEAD_BYTES
    return OWED_BATCHES_PER_STREAM * answer


class OwedAnswers(Generic[T]):
    """Owned by one StreamEnqueue: its reader `put`s each answer with its size, its
    writer `get`s them in order and reports each `written` once gRPC has taken it."""

    __slots__ = ("_answers", "_bytes", "_max_bytes", "_room", "_writer_ended")

    def __init__(self, max_bytes: int) -> None:
        self._answers: asyncio.Queue[T | None] = asyncio.Queue()
        self._max_bytes = max_bytes
        self._bytes = 0
        self._room = asyncio.Event()  # set while the reader may take another request
        self._room.set()
        self._writer_ended = False

    @property
    def owed_bytes(self) -> int:
        return self._bytes

    @property
    def full(self) -> bool:
        return self._bytes >= self._max_bytes

    def put(self, answer: T, size: int) -> None:
        self._answers.put_nowait(answer)
        self.grew(size)

    def grew(self, size: int) -> None:
        """An answer already put turned out `size` bytes larger (or smaller, if negative)
        than counted so far: its results came in."""
        self._bytes += size
        if self.full and not self._writer_ended:
            self._room.clear()
        else:
            self._room.set()

    def end(self) -> None:
        """No more requests: the writer ends after the answers before this."""
        self._answers.put_nowait(None)

    async def room(self) -> None:
        """Returns once the stream owes fewer bytes than its bound, or its writer has
        ended (then nothing will drain them: the reader must see that and stop)."""
        await self._room.wait()

    async def get(self) -> T | None:
        """The next answer to write (None: the end); it stays counted until `written`."""
        return await self._answers.get()

    def written(self, size: int) -> None:
        """gRPC took an answer counted `size` bytes in all (or it will never be written)."""
        self.grew(-size)

    def writer_ended(self) -> None:
        self._writer_ended = True
        self._room.set()
