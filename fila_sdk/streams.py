"""`enqueue` over an open `StreamEnqueue` stream, with concurrent calls coalesced.

On an open stream a message costs a frame, not a call (SPEC 1: several times the rate
of unary calls; docs/benchmarks.md). `Producer` keeps one stream per connection, opened on the
first enqueue and opened again after a failure, and gathers the enqueues of one
turn of the event loop into one `StreamEnqueueRequest`, built in place
(`messages.add`) so that a message costs no protobuf object of its own. The
request is sealed from a `loop.call_soon` callback (or at once when it reaches
the size cap) and written; the broker answers each request with its sequence
number once its messages are durable, and each caller's future gets its id or
its typed error. Many requests can be in flight on one stream.

A broker that answers `UNIMPLEMENTED` (one that predates the stream) switches the
producer to unary `Enqueue` for good; nothing was stored by the refused stream,
so the requests in flight are sent again that way.

A stream that fails (broker restart, network) fails the enqueues in flight on it
with the mapped error and is not retried here: whether those messages were
stored is unknown. The next enqueue opens a new stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import grpc
import grpc.aio

from fila.v1 import service_pb2, service_pb2_grpc

from ._channel import from_broker, interrupted, map_batch_error, map_rpc_error
from .batching import MAX_BATCH_BYTES, MESSAGE_OVERHEAD_BYTES
from .errors import ClientClosedError, FilaError, RPCError, UnavailableError

# A coalesced request is sealed once it holds this many messages or bytes, so a
# burst is written as several requests the broker can work on while the next
# one is being built, rather than one very large one.
MAX_STREAM_BATCH_MESSAGES: Final = 2_000
MAX_STREAM_BATCH_BYTES: Final = MAX_BATCH_BYTES

Waiters = list[asyncio.Future[str]]

# What writing to (or half-closing) a grpc.aio stream raises once the call has ended,
# depending on how far the ending got; the stream's reader reports why it ended.
CALL_ENDED: Final = (grpc.RpcError, asyncio.InvalidStateError, grpc.aio.InternalError)


def message_bytes(headers: Mapping[str, str] | None, payload: bytes) -> int:
    """About how many bytes a message takes in a request (for the byte budgets)."""
    size = len(payload) + MESSAGE_OVERHEAD_BYTES
    if headers:
        size += sum(map(len, headers)) + sum(map(len, headers.values()))
    return size


def resolve(
    waiters: Sequence[asyncio.Future[str]], results: Sequence[service_pb2.EnqueueResult]
) -> None:
    """Gives each waiter its message id or its typed error, in request order."""
    if len(results) != len(waiters):
        error = RPCError(
            f"the broker answered {len(results)} results for {len(waiters)} messages",
            grpc.StatusCode.INTERNAL,
        )
        fail(waiters, error)
        return
    for waiter, result in zip(waiters, results, strict=True):
        if waiter.done():  # the caller gave up waiting
            continue
        message_id = result.message_id
        if message_id:
            waiter.set_result(message_id)
        else:
            waiter.set_exception(map_batch_error(result.error, "Enqueue"))


async def stream_ending(
    open_stream: Callable[[], grpc.aio.StreamStreamCall[Any, Any]],
) -> grpc.RpcError | None:
    """How the broker ends a bidi-stream RPC opened and half-closed at once: its error,
    or None if it ended cleanly (a broker that has the method and accepts the caller).

    Needed because grpc.aio loses the status of a stream the server ended while the
    client was writing to it (a broker without the method answers UNIMPLEMENTED at
    once; one shutting down answers UNAVAILABLE; a revoked key is refused with
    UNAUTHENTICATED): the failed write replaces it with INTERNAL "Internal error from
    Core". Asking again without writing cannot race."""
    call = open_stream()
    try:
        await call.done_writing()
        async for _ in call:
            pass
    except grpc.RpcError as err:
        return err
    except CALL_ENDED:
        return None
    finally:
        call.cancel()
    return None


async def method_missing(open_stream: Callable[[], grpc.aio.StreamStreamCall[Any, Any]]) -> bool:
    """Whether the broker lacks a bidi-stream RPC (see `stream_ending`)."""
    ending = await stream_ending(open_stream)
    return ending is not None and ending.code() == grpc.StatusCode.UNIMPLEMENTED


def fail(waiters: Sequence[asyncio.Future[str]], error: BaseException) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_exception(error)


class _EnqueueStream:
    """One `StreamEnqueue` call, with the writer and reader tasks it owns."""

    def __init__(
        self,
        stub: service_pb2_grpc.FilaServiceAsyncStub,
        metadata: tuple[tuple[str, str], ...],
        producer: Producer,
    ) -> None:
        # No request iterator: requests are written with `call.write` as they are sealed.
        self._call = stub.StreamEnqueue(metadata=metadata)  # type: ignore[call-arg]
        self._producer = producer
        self._sequence = 0
        self._inflight: dict[int, tuple[service_pb2.StreamEnqueueRequest, Waiters]] = {}
        self._outbox: deque[service_pb2.StreamEnqueueRequest] = deque()
        self._wake = asyncio.Event()
        self.alive = True
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    def send(self, request: service_pb2.StreamEnqueueRequest, waiters: Waiters) -> None:
        self._sequence += 1
        request.sequence_number = self._sequence
        self._inflight[self._sequence] = (request, waiters)
        self._outbox.append(request)
        self._wake.set()

    async def _write(self) -> None:
        call, outbox, wake = self._call, self._outbox, self._wake
        while True:
            while not outbox:
                wake.clear()
                await wake.wait()
            try:
                await call.write(outbox.popleft())
            except CALL_ENDED:
                return  # the reader reports how the call ended

    async def _read(self) -> None:
        error: FilaError = UnavailableError(
            "the broker ended the enqueue stream", grpc.StatusCode.UNAVAILABLE
        )
        inflight = self._inflight
        answered = False
        try:
            async for response in self._call:
                answered = True
                entry = inflight.pop(response.sequence_number, None)
                if entry is not None:
                    resolve(entry[1], response.results)
        except grpc.RpcError as err:
            real = err
            if not answered and interrupted(err):  # the status was lost: ask again
                real = await self._producer.stream_ending() or err
            if real.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.alive = False
                requests = [request for request, _ in inflight.values()]
                batches = [waiters for _, waiters in inflight.values()]
                inflight.clear()
                await self._producer.fall_back(requests, batches)
                return
            if interrupted(real) or (real is not err and not from_broker(real)):
                error = UnavailableError(
                    f"the enqueue stream was interrupted ({err.details()})",
                    grpc.StatusCode.UNAVAILABLE,
                )
            else:  # as the broker answered (a refused key, say), not as the write failed
                error = map_rpc_error(real, "Enqueue")
        except asyncio.CancelledError:
            error = ClientClosedError()
            raise
        finally:
            self.alive = False
            self._writer.cancel()
            for _, waiters in inflight.values():
                fail(waiters, error)
            inflight.clear()

    @property
    def finished(self) -> bool:
        return self._reader.done() and self._writer.done()

    async def aclose(self) -> None:
        self._call.cancel()
        for task in (self._writer, self._reader):
            task.cancel()
        for task in (self._writer, self._reader):
            with contextlib.suppress(asyncio.CancelledError):
                await task


class Producer:
    """The enqueue path of one `AsyncClient`: coalescing, streams, unary fallback."""

    def __init__(
        self,
        stubs: Sequence[service_pb2_grpc.FilaServiceAsyncStub],
        metadata: tuple[tuple[str, str], ...],
        *,
        max_messages: int = MAX_STREAM_BATCH_MESSAGES,
        max_bytes: int = MAX_STREAM_BATCH_BYTES,
    ) -> None:
        self._stubs = stubs
        self._metadata = metadata
        self._max_messages = max_messages
        self._max_bytes = max_bytes
        self._streams: list[_EnqueueStream | None] = [None] * len(stubs)
        self._retired: list[_EnqueueStream] = []  # failed streams, closed with the producer
        self._turn = 0
        self._pending: service_pb2.StreamEnqueueRequest | None = None
        self._waiters: Waiters = []
        self._bytes = 0
        self._scheduled = False
        self._unary_only = False
        self._closed = False
        self._fallbacks: set[asyncio.Task[None]] = set()
        self.requests_sent = 0  # coalesced requests written (for tests and tuning)

    @property
    def unary_only(self) -> bool:
        return self._unary_only

    async def enqueue(
        self, queue: str, headers: Mapping[str, str] | None, payload: bytes, delay_ms: int
    ) -> str:
        if self._closed:
            raise ClientClosedError()
        if self._unary_only:
            request = service_pb2.EnqueueRequest(
                queue=queue, headers=headers, payload=payload, delay_ms=delay_ms
            )
            return await self._unary(request)
        loop = asyncio.get_running_loop()
        pending = self._pending
        if pending is None:
            pending = self._pending = service_pb2.StreamEnqueueRequest()
        pending.messages.add(queue=queue, headers=headers, payload=payload, delay_ms=delay_ms)
        waiter: asyncio.Future[str] = loop.create_future()
        self._waiters.append(waiter)
        self._bytes += message_bytes(headers, payload)
        if len(self._waiters) >= self._max_messages or self._bytes >= self._max_bytes:
            self._seal()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._seal)
        return await waiter

    def _seal(self) -> None:
        self._scheduled = False
        request, waiters = self._pending, self._waiters
        if request is None:
            return
        self._pending, self._waiters, self._bytes = None, [], 0
        if self._unary_only:
            self._spawn_fallback([request], [waiters])
            return
        index = self._turn
        self._turn = (index + 1) % len(self._stubs)
        stream = self._streams[index]
        if stream is None or not stream.alive:
            if stream is not None:
                self._retired = [s for s in self._retired if not s.finished]
                self._retired.append(stream)
            stream = self._streams[index] = _EnqueueStream(self._stubs[index], self._metadata, self)
        stream.send(request, waiters)
        self.requests_sent += 1

    async def stream_ending(self) -> grpc.RpcError | None:
        """How a StreamEnqueue ends when nothing is written: why a stream that failed
        before any answer failed (see `fila_sdk.streams.stream_ending`)."""
        stub = self._stubs[0]
        return await stream_ending(lambda: stub.StreamEnqueue(metadata=self._metadata))  # type: ignore[call-arg]

    async def fall_back(
        self, requests: Sequence[service_pb2.StreamEnqueueRequest], waiters: Sequence[Waiters]
    ) -> None:
        """The broker has no StreamEnqueue: unary from now on, starting with these."""
        self._unary_only = True
        sends = [
            self._unary_into(message, waiter)
            for request, batch_waiters in zip(requests, waiters, strict=True)
            for message, waiter in zip(request.messages, batch_waiters, strict=True)
        ]
        try:
            await asyncio.gather(*sends)
        except asyncio.CancelledError:
            for batch_waiters in waiters:
                fail(batch_waiters, ClientClosedError())
            raise

    def _spawn_fallback(
        self, requests: Sequence[service_pb2.StreamEnqueueRequest], waiters: Sequence[Waiters]
    ) -> None:
        task = asyncio.get_running_loop().create_task(self.fall_back(requests, waiters))
        self._fallbacks.add(task)
        task.add_done_callback(self._fallbacks.discard)

    async def _unary(self, request: service_pb2.EnqueueRequest) -> str:
        stub = self._stubs[self._turn]
        self._turn = (self._turn + 1) % len(self._stubs)
        try:
            response = await stub.Enqueue(request, metadata=self._metadata)
        except grpc.RpcError as err:
            raise map_rpc_error(err, "Enqueue") from err
        return response.message_id

    async def _unary_into(
        self, request: service_pb2.EnqueueRequest, waiter: asyncio.Future[str]
    ) -> None:
        try:
            message_id = await self._unary(request)
        except FilaError as exc:
            if not waiter.done():
                waiter.set_exception(exc)
            return
        if not waiter.done():
            waiter.set_result(message_id)

    async def aclose(self) -> None:
        """Fails the enqueues not yet answered with `ClientClosedError`."""
        self._closed = True
        fail(self._waiters, ClientClosedError())
        self._pending, self._waiters = None, []
        for stream in [*self._streams, *self._retired]:
            if stream is not None:
                await stream.aclose()
        tasks = list(self._fallbacks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
