#!/usr/bin/env python3
"""What wrong API keys cost a legitimate client: its latency with and without a flood.

Starts a real broker with auth on, then measures a legitimate producer (one
Enqueue in flight, a valid key) alone for `--baseline-s` seconds, and again while a
separate attacker process sends `--attack-keys` Enqueue calls with random wrong
keys, `--concurrency` in flight (each worker on its own connection). Prints the
legitimate client's p50/p99/max in both phases and how long the attack took.

    .venv/bin/python scripts/auth_flood.py                 # 1,000 wrong keys, 50 in flight
    .venv/bin/python scripts/auth_flood.py --concurrency 1000   # all at once

The attacker runs in its own process so that its client-side work does not share
the legitimate client's event loop; both share the machine with the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import grpc.aio

from fila.server.process import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

QUEUE = "flood"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def legit(addr: str, key: str, stop: asyncio.Event | None, seconds: float) -> list[float]:
    """Closed loop, one call in flight; returns latencies in ms."""
    metadata = (("authorization", f"Bearer {key}"),)
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(addr) as channel:
        enqueue = service_pb2_grpc.FilaServiceStub(channel).Enqueue
        request = service_pb2.EnqueueRequest(queue=QUEUE, payload=b"x" * 100)
        for _ in range(200):  # warm up
            await enqueue(request, metadata=metadata)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
            start = time.perf_counter()
            await enqueue(request, metadata=metadata)
            latencies.append((time.perf_counter() - start) * 1000)
    return latencies


def attack(addr: str, keys: int, concurrency: int, started: object, result: object) -> None:
    """Runs in a child process: `keys` wrong-key calls, `concurrency` in flight."""

    async def run() -> tuple[float, dict[str, int]]:
        remaining = keys
        codes: dict[str, int] = {}
        channels = [grpc.aio.insecure_channel(addr) for _ in range(min(concurrency, 50))]
        for channel in channels:
            await channel.channel_ready()
        request = service_pb2.EnqueueRequest(queue=QUEUE, payload=b"x")

        async def worker(index: int) -> None:
            nonlocal remaining
            stub = service_pb2_grpc.FilaServiceStub(channels[index % len(channels)])
            while remaining > 0:
                remaining -= 1
                wrong = "fila_" + secrets.token_urlsafe(32)
                try:
                    await stub.Enqueue(request, metadata=(("authorization", f"Bearer {wrong}"),))
                    code = "OK"
                except grpc.aio.AioRpcError as err:
                    code = err.code().name
                codes[code] = codes.get(code, 0) + 1

        started.set()  # type: ignore[attr-defined]
        start = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - start
        for channel in channels:
            await channel.close()
        return elapsed, codes

    result.put(asyncio.run(run()))  # type: ignore[attr-defined]


async def measure(args: argparse.Namespace, addr: str, key: str) -> None:
    baseline = await legit(addr, key, None, args.baseline_s)
    ctx = multiprocessing.get_context("spawn")
    started, done, result = ctx.Event(), asyncio.Event(), ctx.Queue()
    proc = ctx.Process(
        target=attack, args=(addr, args.attack_keys, args.concurrency, started, result)
    )
    proc.start()
    await asyncio.to_thread(started.wait)

    async def wait_attacker() -> tuple[float, dict[str, int]]:
        out: tuple[float, dict[str, int]] = await asyncio.to_thread(result.get)
        done.set()
        return out

    attacked, (elapsed, codes) = await asyncio.gather(
        legit(addr, key, done, args.max_attack_s), wait_attacker()
    )
    proc.join()
    for label, samples in (("without attack", baseline), ("with attack", attacked)):
        print(
            f"legit client {label:15s}: n={len(samples):6d}  "
            f"p50={statistics.median(samples):.3f} ms  p99={percentile(samples, 0.99):.3f} ms  "
            f"max={max(samples):.3f} ms"
        )
    rate = args.attack_keys / elapsed
    print(
        f"attack: {args.attack_keys} wrong keys, {args.concurrency} in flight, "
        f"took {elapsed:.2f} s ({rate:.0f}/s); answers {codes}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attack-keys", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--baseline-s", type=float, default=5.0)
    parser.add_argument("--max-attack-s", type=float, default=120.0)
    args = parser.parse_args()
    boot = "boot-" + secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(Path(tmp) / "data", env={"FILA_BOOTSTRAP_APIKEY": boot})
        with server:
            with grpc.insecure_channel(server.addr) as channel:
                admin_pb2_grpc.FilaAdminStub(channel).CreateQueue(
                    admin_pb2.CreateQueueRequest(name=QUEUE),
                    metadata=(("authorization", f"Bearer {boot}"),),
                )
            asyncio.run(measure(args, server.addr, boot))
            failures = server.log_text().count("auth failed")
            print(f"broker alive: {server.running}; 'auth failed' log lines: {failures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
