#!/usr/bin/env python3
"""Where a durable enqueue's CPU goes, thread by thread, beside a bare gRPC echo server.

    .venv/bin/python scripts/thread_cpu.py [--connections 1,8,50] [--seconds 5] [--rounds 3]
        [--drain MESSAGES]

For each connection count it runs, alternately, `fila-server` (`persist_mode =
"sync"`, as the harness's durable cells) and `fila_bench.echo` (a grpc.aio server
answering `StreamEnqueue` with canned ids, with the broker's gRPC settings), each
pinned to CPU 0, under that many `fila_sdk.AsyncClient`s on connections of their own,
each with one 256-byte `enqueue` in flight, from this process pinned to CPU 1 (the
harness's placement). It reads every thread's user and system CPU from /proc before
and after the window, names the threads with `py-spy dump` (their Python names:
`MainThread` runs the event loop, `fila-fsync` the WAL's fdatasync, grpc.aio's poller
`Thread-N (_poll_wrapper)`), and prints each thread's CPU per message, the medians
of the rounds, with this process's own (the load generator's: on a one-in-flight
path its CPU is part of every round trip, and where its core is full, the rate is
its own). The difference between the two servers, thread by thread, is what the
broker costs beyond gRPC's own per-message work (figures: docs/benchmarks.md, "Where
a durable enqueue's CPU goes, thread by thread").

With `--drain`, the load is a drain instead, Fila only (the echo server has no
queue): a queue preloaded with MESSAGES, emptied by one `fila_sdk.Worker` per
connection, each with one message in flight, acked on its stream.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import fila
from fila.testing.children import free_port
from fila.testing.server import ServerProcess
from fila_bench.load import worker_drain
from fila_sdk import AsyncClient

SERVER_CPU, CLIENT_CPU = 0, 1
PAYLOAD = b"x" * 256
LOCAL_POOL = (("grpc.use_local_subchannel_pool", 1),)
BROKER_GRPC_EXPERIMENTS = "-event_engine_listener"  # what fila.server.grpc_runtime sets
CONFIG = '[storage]\npersist_mode = "sync"\n\n[scheduler]\nconsumer_buffer = 1\n'

# A thread's heading in `py-spy dump`: `Thread 523 (idle): "fila-fsync"`.
THREAD_LINE = re.compile(r'^Thread (\d+) \([^)]*\): "([^"]*)"', re.MULTILINE)
# (user, system) clock ticks of each thread, by native thread id
Ticks = dict[int, tuple[int, int]]


def thread_ticks(pid: int) -> Ticks:
    ticks: Ticks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text(encoding="ascii")
        except OSError:
            continue  # ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        ticks[int(tid)] = int(fields[11]), int(fields[12])
    return ticks


def thread_names(pid: int) -> dict[int, str]:
    """Python's names of the process's threads, from `py-spy dump` (empty without it)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {}
    done = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
    return {int(m[1]): m[2] for m in THREAD_LINE.finditer(done.stdout)}


def pin(pid: int, cpu: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), {cpu})


@contextlib.asynccontextmanager
async def fila_server() -> AsyncIterator[tuple[str, int]]:
    with (
        tempfile.TemporaryDirectory(prefix="thread-cpu-") as workdir,
        ServerProcess(Path(workdir) / "data", config_toml=CONFIG) as server,
    ):
        async with AsyncClient(server.addr) as admin:
            await admin.create_queue("q")
        yield server.addr, server.pid


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[tuple[str, int]]:
    port = free_port()
    env = dict(os.environ, GRPC_EXPERIMENTS=BROKER_GRPC_EXPERIMENTS, GRPC_VERBOSITY="ERROR")
    command = [sys.executable, "-m", "fila_bench.echo", str(port)]
    process = await asyncio.create_subprocess_exec(*command, stdin=subprocess.PIPE, env=env)
    try:
        yield f"127.0.0.1:{port}", process.pid
    finally:
        assert process.stdin is not None
        process.stdin.close()  # the echo server exits when its stdin closes
        await asyncio.wait_for(process.wait(), 30)


async def measure(
    server: Callable[[], contextlib.AbstractAsyncContextManager[tuple[str, int]]],
    connections: int,
    seconds: float,
) -> tuple[float, dict[str, float]]:
    """The rate, and each thread's CPU per message in microseconds, by thread name."""
    async with server() as (addr, pid):
        pin(pid, SERVER_CPU)
        clients = [AsyncClient(addr, channel_options=LOCAL_POOL) for _ in range(connections)]
        deadline = time.monotonic() + 30
        while True:  # until every connection is up (the echo server starts in the background)
            try:
                await asyncio.gather(*(c.enqueue("q", None, PAYLOAD) for c in clients))
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        sent = 0
        end = time.monotonic() + seconds

        async def produce(client: AsyncClient) -> None:
            nonlocal sent
            while time.monotonic() < end:
                await client.enqueue("q", None, PAYLOAD)
                sent += 1

        before, started, own = thread_ticks(pid), time.monotonic(), os.times()
        await asyncio.gather(*(produce(c) for c in clients))
        elapsed, after, own_after = time.monotonic() - started, thread_ticks(pid), os.times()
        names = thread_names(pid)
        for client in clients:
            await client.close()
    return sent / elapsed, per_message(before, after, names, own, own_after, sent)


async def measure_drain(connections: int, messages: int) -> tuple[float, dict[str, float]]:
    """`--drain`: the rate, and each thread's CPU per message, while one
    `fila_sdk.Worker` per connection (one message in flight, acked on its stream, as
    `fila-bench`'s drains and the harness's) empties a queue preloaded with
    `messages`."""
    async with fila_server() as (addr, pid):
        pin(pid, SERVER_CPU)
        async with AsyncClient(addr) as loader:
            for start in range(0, messages, 500):
                count = min(500, messages - start)
                await loader.enqueue_many("q", [(None, PAYLOAD)] * count)
        clients = [AsyncClient(addr, channel_options=LOCAL_POOL) for _ in range(connections)]
        before, started, own = thread_ticks(pid), time.monotonic(), os.times()
        done = await worker_drain(clients, "q", messages, deadline_s=300)
        elapsed, after, own_after = time.monotonic() - started, thread_ticks(pid), os.times()
        names = thread_names(pid)
        for client in clients:
            await client.close()
    return done.counted / elapsed, per_message(before, after, names, own, own_after, done.counted)


def per_message(
    before: Ticks,
    after: Ticks,
    names: dict[int, str],
    own: os.times_result,
    own_after: os.times_result,
    count: int,
) -> dict[str, float]:
    """Each server thread's user and system CPU per message in microseconds, their
    sum, and the load generator's (this process, on its own CPU: on a one-in-flight
    path its CPU is part of every round trip too)."""
    per_tick_us = 1e6 / os.sysconf("SC_CLK_TCK") / count
    threads: dict[str, float] = collections.defaultdict(float)
    for tid, (user, system) in after.items():
        user0, system0 = before.get(tid, (0, 0))
        name = names.get(tid, f"thread {tid}")
        threads[f"{name} user"] += (user - user0) * per_tick_us
        threads[f"{name} sys"] += (system - system0) * per_tick_us
    threads["all threads"] = sum(threads.values())
    client_s = (own_after.user - own.user) + (own_after.system - own.system)
    threads["(load generator, all threads)"] = client_s * 1e6 / count
    return dict(threads)


async def run(args: argparse.Namespace) -> None:
    os.sched_setaffinity(0, {CLIENT_CPU})
    servers = {"fila": fila_server} if args.drain else {"fila": fila_server, "echo": echo_server}
    for connections in args.connections:
        rates: dict[str, list[float]] = collections.defaultdict(list)
        costs: dict[str, dict[str, list[float]]] = {
            k: collections.defaultdict(list) for k in servers
        }
        for index in range(args.rounds):
            order = list(servers) if index % 2 == 0 else list(reversed(servers))
            for name in order:
                if args.drain:
                    rate, threads = await measure_drain(connections, args.drain)
                else:
                    rate, threads = await measure(servers[name], connections, args.seconds)
                rates[name].append(rate)
                for thread, us in threads.items():
                    costs[name][thread].append(us)
        print(f"\n{connections} connection(s), medians of {args.rounds} rounds")
        for name in servers:
            print(f"  {name}: {statistics.median(rates[name]):,.0f} msg/s")
            rows = sorted(costs[name].items(), key=lambda kv: -statistics.median(kv[1]))
            for thread, values in rows:
                us = statistics.median(values + [0.0] * (args.rounds - len(values)))
                if us >= 0.5:
                    print(f"    {thread:40s} {us:7.1f} us/msg")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--connections", type=lambda s: [int(n) for n in s.split(",")], default=[1, 8, 50]
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--drain",
        type=int,
        default=0,
        metavar="MESSAGES",
        help="measure a drain of MESSAGES preloaded messages by one Worker per "
        "connection instead (Fila only: the echo server has no queue)",
    )
    args = parser.parse_args()
    # the broker runs the checkout this process imported (fila.testing.server)
    print(f"fila from {Path(fila.__file__).resolve().parent.parent}")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
