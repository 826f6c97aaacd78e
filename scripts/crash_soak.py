#!/usr/bin/env python3
"""Crash soak: kill -9 the broker again and again under load, then count what broke.

    python scripts/crash_soak.py [--cycles 20] [--producers 50] [--consumers 50]

Producers enqueue uniquely tagged messages and remember which enqueues were
answered; consumers ack what they receive and remember which acks were answered.
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
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fila.server.process import ServerProcess
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


async def _produce(
    stub: service_pb2_grpc.FilaServiceStub, ledger: Ledger, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        tag = ledger.tag()
        request = service_pb2.EnqueueRequest(queue=QUEUE, headers={"tag": tag}, payload=b"x" * 256)
        try:
            reply = await stub.Enqueue(request, timeout=5, wait_for_ready=True)
        except grpc.aio.AioRpcError:
            ledger.unanswered_enqueues += 1
            await asyncio.sleep(0.05)  # the broker is down: retry pacing, not a wait for state
            continue
        ledger.answered_enqueues[tag] = reply.message_id


async def _consume(
    stub: service_pb2_grpc.FilaServiceStub, ledger: Ledger, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        try:
            call = stub.Consume(service_pb2.ConsumeRequest(queue=QUEUE), wait_for_ready=True)
            async for frame in call:
                if not frame.HasField("message"):
                    continue
                message = frame.message
                ledger.deliveries.append((message.id, message.headers["tag"], time.monotonic()))
                try:
                    await stub.Ack(
                        service_pb2.AckRequest(queue=QUEUE, message_id=message.id), timeout=5
                    )
                except grpc.aio.AioRpcError:
                    ledger.unanswered_acks += 1
                    continue
                ledger.acked_at[message.id] = time.monotonic()
                if stop.is_set():
                    return
        except grpc.aio.AioRpcError:
            await asyncio.sleep(0.05)  # the broker is down: reconnect pacing


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
        asyncio.create_task(_produce(stubs[i % CHANNELS], ledger, stop_producing))
        for i in range(producers)
    ] + [
        asyncio.create_task(_consume(stubs[i % CHANNELS], ledger, stop_consuming))
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
