#!/usr/bin/env python3
"""What wrong API keys cost a legitimate client: its latency with and without a flood.

Starts a real broker with auth on and measures a legitimate producer (one Enqueue
in flight, a valid key) for `--baseline-s` seconds, then while a separate attacker
process sends `--attack-keys` Enqueue calls with random wrong keys, `--concurrency`
in flight over up to 50 connections, then again for `--baseline-s` seconds. Prints
the legitimate client's p50/p99/max in each phase (the two quiet phases show how
noisy the machine is), the broker's CPU use in each phase (what the attack costs
the broker, whatever else the machine is doing) and how long the attack took.

    .venv/bin/python scripts/auth_flood.py                 # 1,000 wrong keys, 50 in flight
    .venv/bin/python scripts/auth_flood.py --concurrency 1000   # all at once

The attacker runs in its own process so that its client-side work does not share
the legitimate client's event loop; both share the machine with the broker.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import grpc.aio

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

QUEUE = "flood"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def legit(
    addr: str, key: str, stop: asyncio.Event | None, seconds: float, warm_up: int = 0
) -> list[tuple[float, float]]:
    """Closed loop, one call in flight; returns (start time, latency ms) per call."""
    metadata = (("authorization", f"Bearer {key}"),)
    samples: list[tuple[float, float]] = []
    async with grpc.aio.insecure_channel(addr) as channel:
        enqueue = service_pb2_grpc.FilaServiceStub(channel).Enqueue
        request = service_pb2.EnqueueRequest(queue=QUEUE, payload=b"x" * 100)
        for _ in range(warm_up):
            await enqueue(request, metadata=metadata)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline and not (stop is not None and stop.is_set()):
            start = time.perf_counter()
            await enqueue(request, metadata=metadata)
            samples.append((start, (time.perf_counter() - start) * 1000))
    return samples


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


def cpu_seconds(pid: int) -> float:
    """The broker's user + system CPU time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Phase:
    """Wall time and broker CPU time of one phase: CPU is what the attack costs the
    broker regardless of how busy the rest of the machine is."""

    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._wall = time.perf_counter()
        self._cpu = cpu_seconds(pid)

    def end(self) -> tuple[float, float]:
        return time.perf_counter() - self._wall, cpu_seconds(self._pid) - self._cpu


def report(label: str, samples: list[tuple[float, float]], wall: float, cpu: float) -> None:
    latencies = [ms for _, ms in samples]
    print(
        f"legit client {label:18s}: n={len(latencies):6d}  "
        f"p50={statistics.median(latencies):7.3f} ms  p99={percentile(latencies, 0.99):8.3f} ms  "
        f"max={max(latencies):8.3f} ms | broker CPU {100 * cpu / wall:5.1f}% "
        f"({1000 * cpu / len(latencies):.3f} ms per legit call)"
    )


async def measure(args: argparse.Namespace, addr: str, key: str, pid: int) -> None:
    await legit(addr, key, None, 0.0, warm_up=500)
    phase = Phase(pid)
    before = await legit(addr, key, None, args.baseline_s)
    before_cost = phase.end()
    ctx = multiprocessing.get_context("spawn")
    started, done, result = ctx.Event(), asyncio.Event(), ctx.Queue()
    proc = ctx.Process(
        target=attack, args=(addr, args.attack_keys, args.concurrency, started, result)
    )
    proc.start()
    await asyncio.to_thread(started.wait)
    attack_start = time.perf_counter()
    phase = Phase(pid)

    async def wait_attacker() -> tuple[float, dict[str, int]]:
        out: tuple[float, dict[str, int]] = await asyncio.to_thread(result.get)
        done.set()
        return out

    during, (elapsed, codes) = await asyncio.gather(
        legit(addr, key, done, args.max_attack_s), wait_attacker()
    )
    during_cost = phase.end()
    proc.join()
    phase = Phase(pid)
    after = await legit(addr, key, None, args.baseline_s)
    after_cost = phase.end()
    report("before the attack", before, *before_cost)
    report("during the attack", during, *during_cost)
    report("after the attack", after, *after_cost)
    slowest = sorted(during, key=lambda s: -s[1])[:3]
    print(
        "slowest during: "
        + ", ".join(f"{ms:.1f} ms at +{start - attack_start:.2f} s" for start, ms in slowest)
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
    parser.add_argument("--baseline-s", type=float, default=10.0)
    parser.add_argument("--max-attack-s", type=float, default=120.0)
    parser.add_argument("--persist-mode", choices=("sync", "buffer"), default="sync")
    args = parser.parse_args()
    boot = "boot-" + secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(
            Path(tmp) / "data",
            env={"FILA_BOOTSTRAP_APIKEY": boot},
            persist_mode=args.persist_mode,
        )
        with server:
            with grpc.insecure_channel(server.addr) as channel:
                admin_pb2_grpc.FilaAdminStub(channel).CreateQueue(
                    admin_pb2.CreateQueueRequest(name=QUEUE),
                    metadata=(("authorization", f"Bearer {boot}"),),
                )
            asyncio.run(measure(args, server.addr, boot, server.pid))
            failures = server.log_text().count("auth failed")
            print(f"broker alive: {server.running}; 'auth failed' log lines: {failures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
