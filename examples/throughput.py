"""How fast one Python process moves 1 KB messages through the SDK's batch paths.

    python examples/throughput.py MODE [SECONDS]

starts a broker of its own (a `fila-server` child process, `persist_mode = "sync"`,
on a temporary data directory) and runs one single-process workload against it:

- `many`:      one producer calling `enqueue_many` with 10,000 messages per call;
- `coalesce`:  2,000 tasks each awaiting `AsyncClient.enqueue` in a loop, so the
               client coalesces what they enqueue in one turn of the loop into one
               StreamEnqueue request;
- `lifecycle`: 1,000 such producer tasks, and an async `Worker` (concurrency 8,
               prefetch 2,000) consuming and acking on the same event loop.

The rate is counted by the broker (`GetStats` enqueued or acked totals) over the
measured window, after a one-second warm-up. It also prints the CPU time each side
spent per message, and how long their threads waited for a CPU: on a shared
machine that wait, not the SDK or the broker, often sets the rate.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from fila.testing.server import ServerProcess
from fila_sdk import AsyncClient, Message, Worker

PAYLOAD = b"x" * 1024
QUEUE = "throughput"
WARMUP_S = 1.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def waited_seconds(pid: int) -> float:
    """Time the process's threads spent runnable but waiting for a CPU."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except OSError:
            continue  # the thread ended meanwhile
    return total / 1e9


async def many(client: AsyncClient, stop: asyncio.Event) -> None:
    items = [PAYLOAD] * 10_000
    while not stop.is_set():
        await client.enqueue_many(QUEUE, items)


async def coalesce(client: AsyncClient, stop: asyncio.Event, tasks: int = 2_000) -> None:
    async def producer() -> None:
        while not stop.is_set():
            await client.enqueue(QUEUE, None, PAYLOAD)

    await asyncio.gather(*(producer() for _ in range(tasks)))


async def lifecycle(client: AsyncClient, stop: asyncio.Event) -> None:
    async def handle(message: Message) -> None:
        return None  # the work itself is not what is measured

    async with Worker(client, QUEUE, handle, concurrency=8, prefetch=2_000):
        await coalesce(client, stop, tasks=1_000)


WORKLOADS: dict[str, Callable[[AsyncClient, asyncio.Event], Coroutine[Any, Any, None]]] = {
    "many": many,
    "coalesce": coalesce,
    "lifecycle": lifecycle,
}


async def measure(addr: str, broker_pid: int, mode: str, seconds: float) -> None:
    async with AsyncClient(addr) as client:
        await client.create_queue(QUEUE, exist_ok=True)
        stop = asyncio.Event()
        load = asyncio.create_task(WORKLOADS[mode](client, stop))
        await asyncio.sleep(WARMUP_S)

        def counted(stats: object) -> int:
            return int(getattr(stats, "acked_total" if mode == "lifecycle" else "enqueued_total"))

        me = os.getpid()
        start = counted(await client.get_stats(QUEUE))
        t0, b0, c0 = time.perf_counter(), cpu_seconds(broker_pid), cpu_seconds(me)
        bw0, cw0 = waited_seconds(broker_pid), waited_seconds(me)
        await asyncio.sleep(seconds)
        end = counted(await client.get_stats(QUEUE))
        elapsed = time.perf_counter() - t0
        broker_cpu, client_cpu = cpu_seconds(broker_pid) - b0, cpu_seconds(me) - c0
        broker_wait, client_wait = waited_seconds(broker_pid) - bw0, waited_seconds(me) - cw0
        stop.set()
        await load
    count = end - start
    print(
        f"{mode}: {count / elapsed:,.0f} msg/s; CPU per message: broker "
        f"{1e6 * broker_cpu / count:.1f} us, client {1e6 * client_cpu / count:.1f} us; "
        f"waiting for a CPU: broker {broker_wait / elapsed:.2f}, "
        f"client {client_wait / elapsed:.2f} thread-seconds per second"
    )


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "coalesce"
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    if mode not in WORKLOADS:
        sys.exit(f"usage: throughput.py {{{'|'.join(WORKLOADS)}}} [SECONDS]")
    with (
        tempfile.TemporaryDirectory() as workdir,
        ServerProcess(Path(workdir) / "data", persist_mode="sync") as server,
    ):
        asyncio.run(measure(server.addr, server.pid, mode, seconds))


if __name__ == "__main__":
    main()
