#!/usr/bin/env python3
"""Crash soak: kill -9 the broker again and again under load, then count what broke.

    python scripts/crash_soak.py [--cycles 20] [--producers 50] [--consumers 50]

Producers enqueue uniquely tagged messages and remember which enqueues were
answered; consumers ack what they receive and remember which acks were answered.
Every path is exercised: producers take turns on unary `Enqueue`, `EnqueueBatch`
(10 per call) and `StreamEnqueue` (5 per request); consumers on `Consume` with
unary `Ack`, and `StreamConsume` (max_batch 10) with confirmed `AckBatch` acks or
with acks written on the stream (unconfirmed, so never counted as answered).
Every cycle runs the load for a random 0.5-2.5 s, SIGKILLs the broker, and starts
it again on the same data directory. At the end the queue is drained and:

- lost: an answered enqueue that was never delivered (sync mode promises none);
- duplicated: one tag stored under two message ids (the broker stored a message twice);
- resurrected: a message delivered again after its ack was answered.

An enqueue or ack whose answer never came (the broker died first) may go either
way; those are counted as "unanswered", never as failures. Exits 1 unless lost,
duplicated and resurrected are all 0. Not part of the test suite: it takes a few
minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

QUEUE = "soak"
CHANNELS = 8
# Reconnect at once after each restart instead of gRPC's default backoff of seconds.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]


@dataclass
class Ledger:
    answered_enqueues: dict[str, str] = field(default_factory=dict)  # tag -> id
    unanswered_enqueues: int = 0
    acked_at: dict[str, float] = field(default_factory=dict)  # id -> when the ack answered
    unanswered_acks: int = 0
    deliveries: list[tuple[str, str, float]] = field(default_factory=list)  # id, tag, when
    next_tag: int = 0

    def tag(self) -> str:
        self.next_tag += 1
        return f"t{self.next_tag}"


def _message(ledger: Ledger) -> tuple[str, service_pb2.EnqueueRequest]:
    tag = ledger.tag()
    return tag, service_pb2.EnqueueRequest(queue=QUEUE, headers={"tag": tag}, payload=b"x" * 256)


def _record(ledger: Ledger, tags: list[str], results: Iterable[service_pb2.EnqueueResult]) -> None:
    for tag, result in zip(tags, results, strict=True):
        if result.WhichOneof("result") == "message_id":
            ledger.answered_enqueues[tag] = result.message_id
        else:
            ledger.unanswered_enqueues += 1


async def _produce(
    stub: service_pb2_grpc.FilaServiceStub, ledger: Ledger, stop: asyncio.Event, path: int
) -> None:
    while not stop.is_set():
        try:
            if path == 0:
                tag, request = _message(ledger)
                reply = await stub.Enqueue(request, timeout=5, wait_for_ready=True)
                ledger.answered_enqueues[tag] = reply.message_id
            elif path == 1:
                tags, requests = zip(*(_message(ledger) for _ in range(10)), strict=True)
                batch = service_pb2.EnqueueBatchRequest(messages=requests)
                try:
                    answer = await stub.EnqueueBatch(batch, timeout=5, wait_for_ready=True)
                except grpc.aio.AioRpcError:
                    ledger.unanswered_enqueues += len(tags) - 1  # one more below
                    raise
                _record(ledger, list(tags), answer.results)
            else:
                await _stream_enqueue(stub, ledger, stop)
        except grpc.aio.AioRpcError:
            ledger.unanswered_enqueues += 1
            await asyncio.sleep(0.05)  # the broker is down: retry pacing, not a wait for state


async def _stream_enqueue(
    stub: service_pb2_grpc.FilaServiceStub, ledger: Ledger, stop: asyncio.Event
) -> None:
    """One StreamEnqueue stream, one request of 5 in flight, until it breaks or stop."""
    call = stub.StreamEnqueue(wait_for_ready=True)
    sequence = 0
    try:
        while not stop.is_set():
            sequence += 1
            tags, requests = zip(*(_message(ledger) for _ in range(5)), strict=True)
            await call.write(
                service_pb2.StreamEnqueueRequest(sequence_number=sequence, messages=requests)
            )
            answer = await call.read()
            if answer is grpc.aio.EOF:
                ledger.unanswered_enqueues += len(tags)
                return
            _record(ledger, list(tags), answer.results)
    finally:
        call.cancel()


async def _consume(
    stub: service_pb2_grpc.FilaServiceStub, ledger: Ledger, stop: asyncio.Event, path: int
) -> None:
    while not stop.is_set():
        try:
            if path == 0:
                await _consume_unary(stub, ledger, stop)
            else:
                await _consume_stream(stub, ledger, stop, ack_on_stream=path == 2)
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)  # the broker is down: reconnect pacing


async def _consume_unary(
    stub: service_pb2_grpc.FilaServiceStub, ledger: Ledger, stop: asyncio.Event
) -> None:
    call = stub.Consume(service_pb2.ConsumeRequest(queue=QUEUE), wait_for_ready=True)
    async for frame in call:
        if not frame.HasField("message"):
            continue
        message = frame.message
        ledger.deliveries.append((message.id, message.headers["tag"], time.monotonic()))
        try:
            await stub.Ack(service_pb2.AckRequest(queue=QUEUE, message_id=message.id), timeout=5)
        except grpc.aio.AioRpcError:
            ledger.unanswered_acks += 1
            continue
        ledger.acked_at[message.id] = time.monotonic()
        if stop.is_set():
            return


async def _consume_stream(
    stub: service_pb2_grpc.FilaServiceStub,
    ledger: Ledger,
    stop: asyncio.Event,
    *,
    ack_on_stream: bool,
) -> None:
    call = stub.StreamConsume(wait_for_ready=True)
    try:
        await call.write(service_pb2.StreamConsumeRequest(queue=QUEUE, max_batch=10, prefetch=20))
        while not stop.is_set():
            frame = await call.read()
            if frame is grpc.aio.EOF:
                return
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
                acks=[service_pb2.AckRequest(queue=QUEUE, message_id=i) for i in ids]
            )
            try:
                answer = await stub.AckBatch(request, timeout=5)
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


async def _depth(addr: str) -> tuple[int, int]:
    async with grpc.aio.insecure_channel(addr) as channel:
        stats = await admin_pb2_grpc.FilaAdminStub(channel).GetStats(
            admin_pb2.GetStatsRequest(queue=QUEUE), timeout=10, wait_for_ready=True
        )
    return stats.depth, stats.in_flight


async def soak(cycles: int, producers: int, consumers: int, workdir: Path) -> dict[str, object]:
    server = ServerProcess(workdir / "data", persist_mode="sync", config_toml="[server]\n")
    server.start()
    async with grpc.aio.insecure_channel(server.addr) as channel:
        await admin_pb2_grpc.FilaAdminStub(channel).CreateQueue(
            admin_pb2.CreateQueueRequest(
                name=QUEUE, config=admin_pb2.QueueConfig(visibility_timeout_ms=2000)
            ),
            timeout=10,
        )
    ledger = Ledger()
    channels = [
        grpc.aio.insecure_channel(server.addr, options=FAST_RECONNECT) for _ in range(CHANNELS)
    ]
    stubs = [service_pb2_grpc.FilaServiceStub(ch) for ch in channels]
    stop_producing, stop_consuming = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(_produce(stubs[i % CHANNELS], ledger, stop_producing, i % 3))
        for i in range(producers)
    ] + [
        asyncio.create_task(_consume(stubs[i % CHANNELS], ledger, stop_consuming, i % 3))
        for i in range(consumers)
    ]
    rng = random.Random(7)
    try:
        for cycle in range(cycles):
            await asyncio.sleep(rng.uniform(0.5, 2.5))  # load runs for a random while
            await asyncio.to_thread(server.kill)
            await asyncio.to_thread(server.start)
            print(
                f"cycle {cycle + 1}/{cycles}: answered enqueues {len(ledger.answered_enqueues)}, "
                f"answered acks {len(ledger.acked_at)}",
                flush=True,
            )
        stop_producing.set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if await _depth(server.addr) == (0, 0):
                break
            await asyncio.sleep(0.2)  # polling the drain with a deadline
        stop_consuming.set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in channels:
            await channel.close()
        server.stop()

    delivered_ids = {message_id for message_id, _, _ in ledger.deliveries}
    lost = [tag for tag, mid in ledger.answered_enqueues.items() if mid not in delivered_ids]
    ids_by_tag: dict[str, set[str]] = {}
    for message_id, tag, _ in ledger.deliveries:
        ids_by_tag.setdefault(tag, set()).add(message_id)
    duplicated = [tag for tag, ids in ids_by_tag.items() if len(ids) > 1]
    resurrected = [
        message_id
        for message_id, _, when in ledger.deliveries
        if message_id in ledger.acked_at and when > ledger.acked_at[message_id]
    ]
    return {
        "cycles": cycles,
        "producers": producers,
        "consumers": consumers,
        "answered_enqueues": len(ledger.answered_enqueues),
        "unanswered_enqueues": ledger.unanswered_enqueues,
        "deliveries": len(ledger.deliveries),
        "answered_acks": len(ledger.acked_at),
        "unanswered_acks": ledger.unanswered_acks,
        "lost": len(lost),
        "duplicated": len(duplicated),
        "resurrected": len(resurrected),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--producers", type=int, default=50)
    parser.add_argument("--consumers", type=int, default=50)
    parser.add_argument("--out", type=Path, help="also write the counts as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fila-soak-") as tmp:
        report = asyncio.run(soak(args.cycles, args.producers, args.consumers, Path(tmp)))
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    failed = report["lost"] or report["duplicated"] or report["resurrected"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
