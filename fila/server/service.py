"""`fila.v1.FilaService`: the hot path, as thin adapters over the broker.

Each handler decodes, calls one broker method, and encodes the answer; the
streams also do flow control. Consume streams send frames the broker already
encoded (identity serializer), see `fila.core.frames`.

Batch and stream calls answer per item: an item's failure is a `BatchError` in
its result, never the call's status, except where SPEC 1 says the whole call is
refused (an empty batch, or one over `server.max_batch_messages`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from fila.core.broker import Broker
from fila.core.consumers import Consumer
from fila.core.errors import BrokerError, InvalidArgument, Unavailable
from fila.core.frames import KEEPALIVE_FRAME, timestamp
from fila.server import access, rpc
from fila.server.access import Kind
from fila.server.owed import ANSWER_OVERHEAD_BYTES, OwedAnswers, owed_bytes_bound
from fila.server.readers import Interrupted, StreamReaders
from fila.server.results import BATCH_RESULTS_TAG, encode_results, stream_answer
from fila.server.rpc import BadRequest, Context
from fila.server.status import OK, batch_error
from fila.storage.backend import StorageError
from fila.v1 import service_pb2

SERVICE_NAME = "fila.v1.FilaService"

log = logging.getLogger("fila.server")


class _StreamDone(BrokerError):
    """The client half-closed a StreamConsume: end the stream with OK."""


class _Ending(Exception):
    """A StreamEnqueue request that ends the stream, once the answers owed are written."""

    def __init__(self, reason: BrokerError) -> None:
        super().__init__(str(reason))
        self.reason = reason


# An answer a StreamEnqueue owes: its encoded response, and the commit it waits for.
_Answer = tuple[bytes, asyncio.Future[None]]


class FilaService:
    def __init__(self, broker: Broker, readers: StreamReaders | None = None) -> None:
        """`readers`: where open StreamEnqueue calls wait for requests, so that the
        shutdown can end them (None: a set of their own that nothing interrupts, so they
        end when the grace period does)."""
        self._broker = broker
        self._readers = readers or StreamReaders()

    # -- enqueue -------------------------------------------------------------------

    async def enqueue(
        self, request: service_pb2.EnqueueRequest, context: Context
    ) -> service_pb2.EnqueueResponse:
        results, committed = self._broker.enqueue((request,))
        result = results[0]
        if isinstance(result, BrokerError):
            raise result
        await committed
        return service_pb2.EnqueueResponse(message_id=result)

    async def enqueue_batch(
        self, request: service_pb2.EnqueueBatchRequest, context: Context
    ) -> bytes:
        """Answers an encoded `EnqueueBatchResponse` (see `encode_results`)."""
        self._check_batch_size(len(request.messages), "messages")
        items, merge = access.screen(Kind.PRODUCE, request.messages, _queue_of)
        results, committed = self._broker.enqueue(items)
        await committed
        return encode_results(merge(results), BATCH_RESULTS_TAG)

    async def stream_enqueue(
        self,
        requests: AsyncIterator[service_pb2.StreamEnqueueRequest | BadRequest],
        context: Context,
    ) -> None:
        """Answers each request, in order, once its stored messages are durable.

        Requests are taken as they arrive and handed to the broker at once, so many
        can be in flight on one stream and share group commits; a second task writes
        the answers as their commits complete. A request that ends the stream (one
        that does not decode, or a key revoked meanwhile) still lets every request
        before it be answered first: those were stored, and a client that never
        heard so could only enqueue them again."""
        answers: OwedAnswers[_Answer] = OwedAnswers(
            owed_bytes_bound(self._broker.settings.max_batch_messages)
        )

        async def write_answers() -> None:
            try:
                while (item := await answers.get()) is not None:
                    encoded, committed = item
                    await committed
                    await context.write(encoded)
                    answers.written(len(encoded) + ANSWER_OVERHEAD_BYTES)
            finally:
                answers.writer_ended()

        writer = asyncio.create_task(write_answers())
        ending: BrokerError | None = None
        try:
            try:
                with self._readers.reading():
                    await self._take_requests(requests, answers, writer)
            except _Ending as end:
                ending = end.reason
            except Interrupted:
                ending = Unavailable("broker is shutting down")
            answers.end()
            await writer
            if ending is not None:
                raise ending
        finally:
            if not writer.done():
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, BrokerError, StorageError):
                    await writer
            elif not writer.cancelled():
                # Retrieved, or asyncio logs it with a traceback when the task is
                # collected: a write that failed because the client left, seen here
                # when the call's cancellation reached this task first.
                writer.exception()

    async def _take_requests(
        self,
        requests: AsyncIterator[service_pb2.StreamEnqueueRequest | BadRequest],
        answers: OwedAnswers[_Answer],
        writer: asyncio.Task[None],
    ) -> None:
        """Hands each request to the broker as it arrives and queues its answer, until
        the client half-closes or the writer fails; raises `_Ending` for a request
        that ends the stream. While the stream owes its bound of answer bytes, it
        reads no further (see `fila.server.owed`)."""
        async for request in requests:
            if isinstance(request, BadRequest):
                rpc.BAD_REQUESTS.note("StreamEnqueue", request)
                raise _Ending(request.error())
            try:
                access.require_key()
            except BrokerError as exc:
                raise _Ending(exc) from None
            encoded, committed = self._store(request)
            del request  # not kept while the stream waits for room: only the answer is
            answers.put((encoded, committed), len(encoded) + ANSWER_OVERHEAD_BYTES)
            if answers.full:
                await answers.room()
            if writer.done():
                return

    def _store(self, request: service_pb2.StreamEnqueueRequest) -> _Answer:
        """Hands one request to the broker; its encoded answer, and the commit it
        waits for. What the answer was built from (items, errors) ends here."""
        try:
            self._check_batch_size(len(request.messages), "messages", allow_empty=True)
            items, merge = access.screen(Kind.PRODUCE, request.messages, _queue_of)
            stored, committed = self._broker.enqueue(items)
            results = merge(stored)
        except BrokerError as exc:
            results = [exc] * len(request.messages)
            committed = _done()
        return stream_answer(request.sequence_number, results), committed

    # -- consume -------------------------------------------------------------------

    async def consume(self, request: service_pb2.ConsumeRequest, context: Context) -> None:
        broker = self._broker
        consumer = broker.attach_consumer(
            request.queue, prefetch=request.prefetch, max_batch=request.max_batch
        )
        unsubscribe = access.on_key_lost(lambda reason: broker.detach_consumer(consumer, reason))
        try:
            await self._deliver(consumer, context)
        finally:
            unsubscribe()
            broker.detach_consumer(consumer)

    async def stream_consume(
        self,
        requests: AsyncIterator[service_pb2.StreamConsumeRequest | BadRequest],
        context: Context,
    ) -> None:
        """Deliveries out, settlements in, on one stream (see SPEC 1 `StreamConsume`).

        A task reads settlements and applies them in order; an id this stream does
        not hold closes the consumer with NOT_FOUND, which ends the delivery loop
        with that status, and the stream's leases go back to the queue."""
        broker = self._broker
        try:
            opening = await anext(aiter(requests))
        except StopAsyncIteration:
            return  # the client closed before naming a queue
        first = await rpc.checked(opening, "StreamConsume", context)
        access.require_key()  # the stream may have opened before a revocation
        access.require(Kind.CONSUME, first.queue)
        consumer = broker.attach_consumer(
            first.queue,
            prefetch=first.prefetch,
            max_batch=first.max_batch,
            owns_settlement=True,
        )
        queue_name = consumer.queue_name

        def settle(request: service_pb2.StreamConsumeRequest) -> None:
            if request.ack_ids or request.nacks:
                access.require_key()
                broker.settle_on_stream(
                    consumer.id,
                    queue_name,
                    request.ack_ids,
                    [(nack.message_id, nack.error) for nack in request.nacks],
                )

        async def read_settlements() -> None:
            try:
                settle(first)
                async for request in requests:
                    if isinstance(request, BadRequest):
                        rpc.BAD_REQUESTS.note("StreamConsume", request)
                        raise request.error()
                    settle(request)
            except BrokerError as exc:
                consumer.close(exc)
                return
            except Exception as exc:
                # A bug, not the client's doing; never die silently: the stream ends
                # with INTERNAL (its leases go back) and the traceback is logged.
                log.exception("a StreamConsume settlement failed", extra={"queue": queue_name})
                consumer.close(
                    BrokerError(f"the broker failed to apply a settlement: {exc!r}"[:300])
                )
                return
            consumer.close(_StreamDone("stream closed by the client"))

        reader = asyncio.create_task(read_settlements())
        unsubscribe = access.on_key_lost(lambda reason: broker.detach_consumer(consumer, reason))
        try:
            await self._deliver(consumer, context)
        except _StreamDone:
            pass
        finally:
            unsubscribe()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            broker.detach_consumer(consumer)

    async def _deliver(self, consumer: Consumer, context: Context) -> None:
        """Writes frames as the broker buffers deliveries; keepalives when idle.
        Ends by raising the consumer's close reason. A frame's messages count against
        the stream's and the broker's buffer bytes until its write returns, which is
        when gRPC has let it out to the client (see `fila.core.consumers`)."""
        broker = self._broker
        keepalive_s = self._broker.settings.keepalive_s
        limit = consumer.max_batch
        while True:
            frame = broker.sending(consumer, limit)
            if frame is None:
                if not await consumer.wait(keepalive_s):
                    await context.write(KEEPALIVE_FRAME)
                continue
            try:
                await context.write(frame)
            finally:
                broker.sent(consumer)

    # -- settlement ----------------------------------------------------------------

    async def ack(
        self, request: service_pb2.AckRequest, context: Context
    ) -> service_pb2.AckResponse:
        await _single(self._broker.ack(((request.queue, request.message_id),)))
        return service_pb2.AckResponse()

    async def nack(
        self, request: service_pb2.NackRequest, context: Context
    ) -> service_pb2.NackResponse:
        item = (request.queue, request.message_id, request.error)
        await _single(self._broker.nack((item,)))
        return service_pb2.NackResponse()

    async def ack_batch(
        self, request: service_pb2.AckBatchRequest, context: Context
    ) -> service_pb2.AckBatchResponse:
        self._check_batch_size(len(request.acks), "acks")
        acks = [(a.queue, a.message_id) for a in request.acks]
        items, merge = access.screen(Kind.CONSUME, acks, _first)
        results, committed = self._broker.ack(items)
        await committed
        return service_pb2.AckBatchResponse(results=_settle_results(merge(results)))

    async def nack_batch(
        self, request: service_pb2.NackBatchRequest, context: Context
    ) -> service_pb2.NackBatchResponse:
        self._check_batch_size(len(request.nacks), "nacks")
        nacks = [(n.queue, n.message_id, n.error) for n in request.nacks]
        items, merge = access.screen(Kind.CONSUME, nacks, _first)
        results, committed = self._broker.nack(items)
        await committed
        return service_pb2.NackBatchResponse(results=_settle_results(merge(results)))

    async def extend_lease(
        self, request: service_pb2.ExtendLeaseRequest, context: Context
    ) -> service_pb2.ExtendLeaseResponse:
        deadline, committed = self._broker.extend_lease(
            request.queue, request.message_id, request.extend_ms
        )
        await committed
        return service_pb2.ExtendLeaseResponse(deadline=timestamp(deadline))

    # -- plumbing ------------------------------------------------------------------

    def _check_batch_size(self, size: int, what: str, *, allow_empty: bool = False) -> None:
        limit = self._broker.settings.max_batch_messages
        if size == 0 and not allow_empty:
            raise InvalidArgument(f"a batch needs at least one item in {what}")
        if size > limit:
            raise InvalidArgument(
                f"a batch may carry at most {limit} {what} (server.max_batch_messages), got {size}"
            )

    def generic_handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        s = service_pb2
        handlers = {
            "Enqueue": rpc.unary("Enqueue", s.EnqueueRequest, self.enqueue),
            "EnqueueBatch": rpc.unary(
                "EnqueueBatch", s.EnqueueBatchRequest, self.enqueue_batch, raw_response=True
            ),
            "StreamEnqueue": rpc.bidi_stream(
                "StreamEnqueue", s.StreamEnqueueRequest, self.stream_enqueue, raw_responses=True
            ),
            "Consume": rpc.server_stream("Consume", s.ConsumeRequest, self.consume),
            "StreamConsume": rpc.bidi_stream(
                "StreamConsume", s.StreamConsumeRequest, self.stream_consume, raw_responses=True
            ),
            "Ack": rpc.unary("Ack", s.AckRequest, self.ack),
            "Nack": rpc.unary("Nack", s.NackRequest, self.nack),
            "AckBatch": rpc.unary("AckBatch", s.AckBatchRequest, self.ack_batch),
            "NackBatch": rpc.unary("NackBatch", s.NackBatchRequest, self.nack_batch),
            "ExtendLease": rpc.unary("ExtendLease", s.ExtendLeaseRequest, self.extend_lease),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


async def _single(outcome: tuple[list[BrokerError | None], asyncio.Future[None]]) -> None:
    """A batch of one: raise its error, else wait for its commit."""
    results, committed = outcome
    if results[0] is not None:
        raise results[0]
    await committed


def _settle_results(results: Sequence[BrokerError | None]) -> list[service_pb2.BatchError]:
    return [OK if r is None else batch_error(r) for r in results]


def _queue_of(request: service_pb2.EnqueueRequest) -> str:
    return request.queue


def _first(item: tuple[str, ...]) -> str:
    return item[0]


def _done() -> asyncio.Future[None]:
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future
