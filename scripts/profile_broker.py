#!/usr/bin/env python3
"""Where a broker's time goes under one load: py-spy samples of a real fila-server.

    .venv/bin/python scripts/profile_broker.py MODE [--seconds 8] [--persist-mode sync]
        [--top 20] [--raw FILE]

MODE is the load, from this process:
- `unary50`: 50 connections, one unary `Enqueue` of 256 B in flight on each (the
  one-message-per-call design the echo ceiling measures);
- `sdk50`: the same through 50 `AsyncClient`s, whose `enqueue` rides `StreamEnqueue`;
- `unary1`, `sdk1`: as `unary50` and `sdk50` on one connection (the round trip);
- `unary_lifecycle`: one connection enqueuing with unary `Enqueue` while another
  consumes with `Consume` and acks each message with unary `Ack`, one at a time (the
  published clients' way);
- `batch`: four loops of `EnqueueBatch` with 100 messages of 1 KiB;
- `drain`: a backlog preloaded with `batch`, drained by one `StreamConsume` stream
  (max_batch 100, prefetch 1,000) acking on the stream;
- `worker50`: a backlog preloaded with `batch`, drained by 50 `fila_sdk.Worker`s with
  one slot each, on connections of their own (the durability matrix's drain).

It starts a broker on a free port in a temporary directory, attaches
`py-spy record` for the load's duration (py-spy from PyPI; it needs ptrace, so run
as root or with CAP_SYS_PTRACE), and prints the load's rate, the functions with the
most samples of their own, and the inclusive share of the broker's own functions.
Samples inside grpc's Cython code show up as the Python frame that called it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import grpc.aio

from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc
from fila_sdk import AsyncClient, Message, Worker

QUEUE = "p"
LOCAL_POOL = (("grpc.use_local_subchannel_pool", 1),)
# The API key every load presents (`use_key`); none while auth is off.
API_KEY: str | None = None


def use_key(key: str | None) -> None:
    global API_KEY
    API_KEY = key


def _md() -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {API_KEY}"),) if API_KEY else None


async def _create_queue(addr: str) -> None:
    async with grpc.aio.insecure_channel(addr) as channel:
        try:
            await admin_pb2_grpc.FilaAdminStub(channel).CreateQueue(
                admin_pb2.CreateQueueRequest(name=QUEUE), timeout=10, metadata=_md()
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise


async def _unary50(addr: str, end: float, connections: int = 50) -> int:
    channels = [grpc.aio.insecure_channel(addr, options=LOCAL_POOL) for _ in range(connections)]
    request = service_pb2.EnqueueRequest(queue=QUEUE, payload=b"x" * 256)
    sent = 0

    async def loop(stub: service_pb2_grpc.FilaServiceStub) -> None:
        nonlocal sent
        while time.monotonic() < end:
            await stub.Enqueue(request, metadata=_md())
            sent += 1

    await asyncio.gather(*(loop(service_pb2_grpc.FilaServiceStub(c)) for c in channels))
    for channel in channels:
        await channel.close(None)
    return sent


async def _sdk50(addr: str, end: float, connections: int = 50) -> int:
    clients = [
        AsyncClient(addr, api_key=API_KEY, channel_options=LOCAL_POOL) for _ in range(connections)
    ]
    sent = 0

    async def loop(client: AsyncClient) -> None:
        nonlocal sent
        while time.monotonic() < end:
            await client.enqueue(QUEUE, None, b"x" * 256)
            sent += 1

    await asyncio.gather(*(loop(c) for c in clients))
    for client in clients:
        await client.close()
    return sent


async def _batch(addr: str, end: float) -> int:
    request = service_pb2.EnqueueBatchRequest(
        messages=[service_pb2.EnqueueRequest(queue=QUEUE, payload=b"x" * 1024)] * 100
    )
    sent = 0
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = service_pb2_grpc.FilaServiceStub(channel)

        async def loop() -> None:
            nonlocal sent
            while time.monotonic() < end:
                await stub.EnqueueBatch(request, metadata=_md())
                sent += 100

        await asyncio.gather(*(loop() for _ in range(4)))
    return sent


async def _drain(addr: str, end: float) -> int:
    settled: asyncio.Queue[list[str]] = asyncio.Queue()
    received = 0

    async def requests():  # type: ignore[no-untyped-def]
        yield service_pb2.StreamConsumeRequest(queue=QUEUE, max_batch=100, prefetch=1000)
        while True:
            yield service_pb2.StreamConsumeRequest(ack_ids=await settled.get())

    async with grpc.aio.insecure_channel(addr) as channel:
        call = service_pb2_grpc.FilaServiceStub(channel).StreamConsume(requests(), metadata=_md())
        async for frame in call:
            ids = [m.id for m in frame.messages]
            received += len(ids)
            settled.put_nowait(ids)
            if time.monotonic() > end:
                break
        call.cancel()
    return received


async def _unary1(addr: str, end: float) -> int:
    return await _unary50(addr, end, 1)


async def _sdk1(addr: str, end: float) -> int:
    return await _sdk50(addr, end, 1)


async def _unary_lifecycle(addr: str, end: float) -> int:
    """Unary Enqueue on one connection; Consume and unary Ack on another."""
    producer = grpc.aio.insecure_channel(addr, options=LOCAL_POOL)
    consumer = grpc.aio.insecure_channel(addr, options=LOCAL_POOL)
    request = service_pb2.EnqueueRequest(queue=QUEUE, payload=b"x" * 1024)
    acked = 0

    async def produce() -> None:
        stub = service_pb2_grpc.FilaServiceStub(producer)
        while time.monotonic() < end:
            await stub.Enqueue(request, metadata=_md())

    async def consume() -> None:
        nonlocal acked
        stub = service_pb2_grpc.FilaServiceStub(consumer)
        call = stub.Consume(service_pb2.ConsumeRequest(queue=QUEUE), metadata=_md())
        async for response in call:
            if response.message.id:
                ack = service_pb2.AckRequest(queue=QUEUE, message_id=response.message.id)
                await stub.Ack(ack, metadata=_md())
                acked += 1
            if time.monotonic() > end:
                break
        call.cancel()

    await asyncio.gather(produce(), consume())
    for channel in (producer, consumer):
        await channel.close(None)
    return acked


async def _worker50(addr: str, end: float) -> int:
    clients = [AsyncClient(addr, api_key=API_KEY, channel_options=LOCAL_POOL) for _ in range(50)]
    handled = 0

    async def handle(message: Message) -> None:
        nonlocal handled
        handled += 1

    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(Worker(client, QUEUE, handle, concurrency=1))
        await asyncio.sleep(max(0.0, end - time.monotonic()))  # the load runs meanwhile
    for client in clients:
        await client.close()
    return handled


LOADS = {
    "unary50": _unary50,
    "sdk50": _sdk50,
    "unary1": _unary1,
    "sdk1": _sdk1,
    "unary_lifecycle": _unary_lifecycle,
    "batch": _batch,
    "drain": _drain,
    "worker50": _worker50,
}


async def tenant_key(addr: str, boot: str) -> str:
    """A key that may produce and consume on the load's queue, and nothing else (not a
    superadmin: every call is authenticated and checked against its ACL)."""
    async with AsyncClient(addr, api_key=boot) as admin:
        created = await admin.create_api_key("profile-load")
        await admin.set_acl(created.key_id, [f"produce:{QUEUE}", f"consume:{QUEUE}"])
        return created.key


def _summary(raw: Path, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples = int(count)
        total += samples
        frames = stack.split(";")
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    if not total:
        return "no samples"
    lines = [f"{total} samples", "--- own time"]
    lines += [f"{100 * n / total:5.1f}% {f[:140]}" for f, n in own.most_common(top)]
    lines.append("--- inclusive, fila's own functions")
    ours = [(f, n) for f, n in inclusive.most_common() if "fila/" in f and "main.py" not in f]
    lines += [f"{100 * n / total:5.1f}% {f[:140]}" for f, n in ours[:top]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=sorted(LOADS))
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--persist-mode", choices=("sync", "buffer"), default="sync")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--raw", type=Path, help="keep py-spy's raw (collapsed) output here")
    parser.add_argument(
        "--auth",
        action="store_true",
        help="auth on; the load presents a key that may produce and consume on its queue",
    )
    parser.add_argument("--config", default="", help="more of the broker's TOML")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory(prefix="fila-profile-") as tmp:
        boot = "profile-bootstrap-key"
        toml = args.config + (f'\n[auth]\nbootstrap_apikey = "{boot}"\n' if args.auth else "")
        server = ServerProcess(Path(tmp) / "data", config_toml=toml, persist_mode=args.persist_mode)
        server.start()
        try:
            use_key(boot if args.auth else None)
            asyncio.run(_create_queue(server.addr))
            if args.auth:
                use_key(asyncio.run(tenant_key(server.addr, boot)))
            if args.mode in ("drain", "worker50"):  # a backlog to drain
                asyncio.run(_batch(server.addr, time.monotonic() + args.seconds * 0.75))
            raw = args.raw or Path(tmp) / "profile.txt"
            duration = str(int(args.seconds) + 1)
            record = ["record", "-p", str(server.pid), "-d", duration, "-r", "250"]
            spy = subprocess.Popen(
                [py_spy, *record, "-f", "raw", "-o", str(raw)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            load = LOADS[args.mode]
            moved = asyncio.run(load(server.addr, time.monotonic() + args.seconds))
            spy.wait(timeout=args.seconds + 30)
        finally:
            server.stop()
        print(f"{args.mode} ({args.persist_mode}): {moved / args.seconds:,.0f} msg/s")
        print(_summary(raw, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
