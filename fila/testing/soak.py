"""Load that keeps score while brokers are killed: producers and consumers that
remember what they were told, and the verdict that compares it with what happened.

Producers enqueue uniquely tagged messages and remember which enqueues were answered;
consumers ack what they receive and remember which acks were answered. Every path is
exercised: producers take turns on unary `Enqueue`, `EnqueueBatch` (10 per call) and
`StreamEnqueue` (5 per request); consumers on `Consume` with unary `Ack`, and
`StreamConsume` (max_batch 10) with confirmed `AckBatch` acks or with acks written on
the stream (unconfirmed, so never counted as answered). After the run:

- lost: an answered enqueue that was never delivered;
- duplicated: one tag stored under two message ids (a message stored twice);
- resurrected: a message delivered again after its ack was answered.

An enqueue or ack whose answer never came (its broker died first) may go either way:
counted as "unanswered", never as a failure.

Against a cluster (several addresses), producers move to another node when one fails
(any node forwards to the queue's leader), and consumers go where a refusal's
`x-fila-leader-addr` points (a consume is served by the leader only). Used by
`scripts/crash_soak.py` and by the replication tests.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import grpc.aio

from fila.v1 import service_pb2, service_pb2_grpc
from fila.wire import LEADER_ADDR_METADATA_KEY

# Reconnect at once after each restart instead of gRPC's default backoff of seconds.
FAST_RECONNECT: Final = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]
CALL_TIMEOUT_S: Final = 5.0
_EOF: Final[object] = grpc.aio.EOF  # type: ignore[attr-defined]  # a stream read at its end


@dataclass
class Ledger:
    answered_enqueues: dict[str, str] = field(default_factory=dict)  # tag -> id
    unanswered_enqueues: int = 0
    acked_at: dict[str, float] = field(default_factory=dict)  # id -> when the ack answered
    unanswered_acks: int = 0
    deliveries: list[tuple[str, str, float]] = field(default_factory=list)  # id, tag, when
    # (sent, answered) of each enqueue call answered with at least one message id
    answers: list[tuple[float, float]] = field(default_factory=list)
    next_tag: int = 0

    def tag(self) -> str:
        self.next_tag += 1
        return f"t{self.next_tag}"

    def first_answer_after(self, moment: float) -> float | None:
        """When the first enqueue sent after `moment` was answered (None: none yet)."""
        later = [answered for sent, answered in self.answers if sent >= moment]
        return min(later) if later else None

    def verdict(self) -> dict[str, int]:
        delivered_ids = {message_id for message_id, _, _ in self.deliveries}
        lost = [tag for tag, mid in self.answered_enqueues.items() if mid not in delivered_ids]
        ids_by_tag: dict[str, set[str]] = {}
        for message_id, tag, _ in self.deliveries:
            ids_by_tag.setdefault(tag, set()).add(message_id)
        duplicated = [tag for tag, ids in ids_by_tag.items() if len(ids) > 1]
        resurrected = [
            message_id
            for message_id, _, when in self.deliveries
            if message_id in self.acked_at and when > self.acked_at[message_id]
        ]
        return {
            "answered_enqueues": len(self.answered_enqueues),
            "unanswered_enqueues": self.unanswered_enqueues,
            "deliveries": len(self.deliveries),
            "answered_acks": len(self.acked_at),
            "unanswered_acks": self.unanswered_acks,
            "lost": len(lost),
            "duplicated": len(duplicated),
            "resurrected": len(resurrected),
        }


class Targets:
    """Channels to the broker's nodes (one address for a single node), and the node a
    consumer was last pointed to."""

    def __init__(self, addresses: Sequence[str], channels_per_node: int = 4) -> None:
        self.addresses = list(addresses)
        self._channels = {
            addr: [
                grpc.aio.insecure_channel(addr, options=FAST_RECONNECT)
                for _ in range(channels_per_node)
            ]
            for addr in self.addresses
        }
        self._counter = itertools.count()

    def stub(self, addr: str | None = None) -> Any:
        """(`Any`: the generated stubs are typed for synchronous gRPC, these are aio.)"""
        # A stub on `addr` (any node if None), spreading calls over its channels.
        if addr not in self._channels:
            addr = self.addresses[next(self._counter) % len(self.addresses)]
        channels = self._channels[addr]
        return service_pb2_grpc.FilaServiceStub(channels[next(self._counter) % len(channels)])

    async def close(self) -> None:
        for channels in self._channels.values():
            for channel in channels:
                await channel.close(None)


def _message(ledger: Ledger, queue: str) -> tuple[str, service_pb2.EnqueueRequest]:
    tag = ledger.tag()
    return tag, service_pb2.EnqueueRequest(queue=queue, headers={"tag": tag}, payload=b"x" * 256)


def _record(
    ledger: Ledger, sent: float, tags: list[str], results: Iterable[service_pb2.EnqueueResult]
) -> bool:
    """Notes a batch's answers; whether any message was stored."""
    answered = False
    for tag, result in zip(tags, results, strict=True):
        if result.WhichOneof("result") == "message_id":
            ledger.answered_enqueues[tag] = result.message_id
            answered = True
        else:
            ledger.unanswered_enqueues += 1
    if answered:
        ledger.answers.append((sent, time.monotonic()))
    return answered


async def produce(
    targets: Targets, queue: str, ledger: Ledger, stop: asyncio.Event, path: int
) -> None:
    """Enqueues until `stop`, by one of three paths; a failed call moves to another node."""
    while not stop.is_set():
        stub = targets.stub()
        sent = time.monotonic()
        try:
            if path == 0:
                tag, request = _message(ledger, queue)
                reply = await stub.Enqueue(request, timeout=CALL_TIMEOUT_S, wait_for_ready=True)
                ledger.answered_enqueues[tag] = reply.message_id
                ledger.answers.append((sent, time.monotonic()))
            elif path == 1:
                tags, requests = zip(*(_message(ledger, queue) for _ in range(10)), strict=True)
                batch = service_pb2.EnqueueBatchRequest(messages=requests)
                try:
                    answer = await stub.EnqueueBatch(
                        batch, timeout=CALL_TIMEOUT_S, wait_for_ready=True
                    )
                except grpc.aio.AioRpcError:
                    ledger.unanswered_enqueues += len(tags) - 1  # one more below
                    raise
                if not _record(ledger, sent, list(tags), answer.results):
                    await asyncio.sleep(0.05)  # every item refused: retry pacing
            else:
                await _stream_enqueue(stub, queue, ledger, stop)
        except grpc.aio.AioRpcError:
            ledger.unanswered_enqueues += 1
            await asyncio.sleep(0.05)  # retry pacing, not a wait for state


async def _stream_enqueue(stub: Any, queue: str, ledger: Ledger, stop: asyncio.Event) -> None:
    """One StreamEnqueue stream, one request of 5 in flight, until it breaks or stop."""
    call = stub.StreamEnqueue(wait_for_ready=True)
    sequence = 0
    try:
        while not stop.is_set():
            sequence += 1
            tags, requests = zip(*(_message(ledger, queue) for _ in range(5)), strict=True)
            sent = time.monotonic()
            await call.write(
                service_pb2.StreamEnqueueRequest(sequence_number=sequence, messages=requests)
            )
            answer = await call.read()
            if answer is _EOF:
                ledger.unanswered_enqueues += len(tags)
                return
            if not _record(ledger, sent, list(tags), answer.results):
                await asyncio.sleep(0.05)  # every item refused: retry pacing
    finally:
        call.cancel()


async def consume(
    targets: Targets, queue: str, ledger: Ledger, stop: asyncio.Event, path: int
) -> None:
    """Consumes and acks until `stop`, by one of three paths; a refused consume goes to
    the node its `x-fila-leader-addr` names, another failure to another node."""
    addr: str | None = None
    while not stop.is_set():
        try:
            if path == 0:
                await _consume_unary(targets, addr, queue, ledger, stop)
                addr = None
            else:
                addr = await _consume_stream(
                    targets, addr, queue, ledger, stop, ack_on_stream=path == 2
                )
        except grpc.aio.AioRpcError as exc:
            addr = _leader_hint(exc.trailing_metadata())
        await asyncio.sleep(0.05)  # reconnect pacing


def _leader_hint(trailers: object) -> str | None:
    for key, value in trailers or ():  # type: ignore[attr-defined]
        if key == LEADER_ADDR_METADATA_KEY and isinstance(value, str):
            return value
    return None


async def _consume_unary(
    targets: Targets, addr: str | None, queue: str, ledger: Ledger, stop: asyncio.Event
) -> None:
    stub = targets.stub(addr)
    call = stub.Consume(service_pb2.ConsumeRequest(queue=queue), wait_for_ready=True)
    async for frame in call:
        if not frame.HasField("message"):
            continue
        message = frame.message
        ledger.deliveries.append((message.id, message.headers["tag"], time.monotonic()))
        try:
            await targets.stub().Ack(
                service_pb2.AckRequest(queue=queue, message_id=message.id), timeout=CALL_TIMEOUT_S
            )
        except grpc.aio.AioRpcError:
            ledger.unanswered_acks += 1
            continue
        ledger.acked_at[message.id] = time.monotonic()
        if stop.is_set():
            return


async def _consume_stream(
    targets: Targets,
    addr: str | None,
    queue: str,
    ledger: Ledger,
    stop: asyncio.Event,
    *,
    ack_on_stream: bool,
) -> str | None:
    """Returns the node a refusal pointed to, if the stream ended with one."""
    stub = targets.stub(addr)
    call = stub.StreamConsume(wait_for_ready=True)
    try:
        await call.write(service_pb2.StreamConsumeRequest(queue=queue, max_batch=10, prefetch=20))
        while not stop.is_set():
            frame = await call.read()
            if frame is _EOF:
                return _leader_hint(await call.trailing_metadata())
            messages = list(frame.messages) or ([frame.message] if frame.message.id else [])
            now = time.monotonic()
            ids = [m.id for m in messages]
            ledger.deliveries += [(m.id, m.headers["tag"], now) for m in messages]
            if not ids:
                continue
            if ack_on_stream:  # no answer: these acks are never counted as answered
                await call.write(service_pb2.StreamConsumeRequest(ack_ids=ids))
                ledger.unanswered_acks += len(ids)
                continue
            request = service_pb2.AckBatchRequest(
                acks=[service_pb2.AckRequest(queue=queue, message_id=i) for i in ids]
            )
            try:
                answer = await targets.stub().AckBatch(request, timeout=CALL_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                ledger.unanswered_acks += len(ids)
                continue
            acked_at = time.monotonic()
            for message_id, result in zip(ids, answer.results, strict=True):
                if result.code == 0:
                    ledger.acked_at[message_id] = acked_at
                else:
                    ledger.unanswered_acks += 1
    finally:
        call.cancel()
    return None
