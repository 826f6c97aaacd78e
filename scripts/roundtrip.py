#!/usr/bin/env python3
"""Where a single-connection round trip goes: one request in flight, timed in pieces.

    .venv/bin/python scripts/roundtrip.py [--rounds 3000] [--server-cpu 1 --client-cpu 0]

Every process on this host reads the same monotonic clock (`perf_counter_ns`), so a
server can stamp when a request reached its handler and when the answer left it, and
the client can split each round trip into its one-way legs. The script runs, in turn:

- a stamped echo server (this file, `--serve`): `Enqueue` (unary) and
  `StreamEnqueue` (bidi) answer at once, with the two stamps in the message id. Raw
  stubs give gRPC's own legs in each direction; the SDK's `AsyncClient.enqueue`
  against the same stream gives the SDK's share (the SDK hands the id back);
- a real `fila-server` in `buffer` and then in `sync` mode, with a probe on its
  PYTHONPATH (`scripts/roundtrip_probe/sitecustomize.py`, outside the product) that
  stamps where each enqueue is inside the broker: the handler's call into the
  broker, the WAL append, the fsync thread's sync, its hand-back to the event loop.
  The same SDK and raw-stub loops run against it.

Prints the median of every leg over `--rounds` round trips (after 200 not counted),
and the fdatasync of a 300-byte append on the broker's filesystem for reference. The
broker, the echo server and the client are pinned to the CPUs given (`taskset`); pass
`--server-cpu -1` to leave them unpinned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from fila.testing.children import free_port
from fila.testing.server import ServerProcess
from fila.v1 import service_pb2, service_pb2_grpc
from fila_sdk import AsyncClient

HERE = Path(__file__).resolve().parent
PROBE = HERE / "roundtrip_probe"
QUEUE = "rt"
PAYLOAD = b"j" * 256
WARMUP = 200
LOCAL_POOL = (("grpc.use_local_subchannel_pool", 1),)


# -- the stamped echo server -------------------------------------------------------------


def _stamped(t_in: int) -> str:
    return f"{t_in}:{time.perf_counter_ns()}"


async def _echo_unary(request: service_pb2.EnqueueRequest, context: Any) -> Any:
    t_in = time.perf_counter_ns()
    return service_pb2.EnqueueResponse(message_id=_stamped(t_in))


async def _echo_stream(requests: AsyncIterator[Any], context: Any) -> None:
    async for request in requests:
        t_in = time.perf_counter_ns()
        result = service_pb2.EnqueueResult(message_id=_stamped(t_in))
        await context.write(
            service_pb2.StreamEnqueueResponse(
                sequence_number=request.sequence_number, results=[result] * len(request.messages)
            )
        )


async def serve(port: int) -> None:
    server = grpc.aio.server()
    s = service_pb2
    handlers = {
        "Enqueue": grpc.unary_unary_rpc_method_handler(
            _echo_unary,
            request_deserializer=s.EnqueueRequest.FromString,
            response_serializer=s.EnqueueResponse.SerializeToString,
        ),
        "StreamEnqueue": grpc.stream_stream_rpc_method_handler(
            _echo_stream,
            request_deserializer=s.StreamEnqueueRequest.FromString,
            response_serializer=s.StreamEnqueueResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("fila.v1.FilaService", handlers),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


# -- the loops -----------------------------------------------------------------------------

Round = tuple[int, int, str]  # (sent ns, received ns, message id)


async def _rounds(rounds: int, once: Callable[[], Awaitable[str]]) -> list[Round]:
    out: list[Round] = []
    for index in range(WARMUP + rounds):
        sent = time.perf_counter_ns()
        message_id = await once()
        received = time.perf_counter_ns()
        if index >= WARMUP:
            out.append((sent, received, message_id))
    return out


async def raw_unary(addr: str, rounds: int) -> list[Round]:
    async with grpc.aio.insecure_channel(addr, options=LOCAL_POOL) as channel:
        stub = service_pb2_grpc.FilaServiceStub(channel)
        request = service_pb2.EnqueueRequest(queue=QUEUE, payload=PAYLOAD)

        async def once() -> str:
            return str((await stub.Enqueue(request)).message_id)

        return await _rounds(rounds, once)


async def raw_stream(addr: str, rounds: int) -> list[Round]:
    async with grpc.aio.insecure_channel(addr, options=LOCAL_POOL) as channel:
        call = service_pb2_grpc.FilaServiceStub(channel).StreamEnqueue()
        sequence = 0

        async def once() -> str:
            nonlocal sequence
            sequence += 1
            request = service_pb2.StreamEnqueueRequest(sequence_number=sequence)
            request.messages.add(queue=QUEUE, payload=PAYLOAD)
            await call.write(request)
            response = await call.read()
            return str(response.results[0].message_id)

        try:
            return await _rounds(rounds, once)
        finally:
            call.cancel()


async def sdk(addr: str, rounds: int) -> list[Round]:
    async with AsyncClient(addr, channel_options=LOCAL_POOL) as client:

        async def once() -> str:
            return await client.enqueue(QUEUE, None, PAYLOAD)

        return await _rounds(rounds, once)


LOOPS: dict[str, Callable[[str, int], Awaitable[list[Round]]]] = {
    "raw unary Enqueue": raw_unary,
    "raw StreamEnqueue": raw_stream,
    "SDK enqueue (StreamEnqueue)": sdk,
}


# -- reporting -----------------------------------------------------------------------------


def _us(values: list[int]) -> str:
    return f"{statistics.median(values) / 1000:7.1f}" if values else "      -"


def echo_legs(rounds: list[Round]) -> dict[str, str]:
    total, there, handler, back = [], [], [], []
    for sent, received, message_id in rounds:
        t_in, t_out = (int(x) for x in message_id.split(":"))
        total.append(received - sent)
        there.append(t_in - sent)
        handler.append(t_out - t_in)
        back.append(received - t_out)
    return {"round trip": _us(total), "to handler": _us(there), "in handler": _us(handler),
            "handler to client": _us(back)}  # fmt: skip


def broker_legs(rounds: list[Round], stamps: list[dict[str, int]]) -> dict[str, str]:
    """Pairs the k-th round with the k-th enqueue the probe saw (one in flight)."""
    stamps = stamps[-len(rounds) :]
    legs: dict[str, list[int]] = {}

    def add(name: str, value: int | None) -> None:
        if value is not None:
            legs.setdefault(name, []).append(value)

    for (sent, received, _), s in zip(rounds, stamps, strict=False):
        add("round trip", received - sent)
        add("to broker.enqueue", s["enqueue"] - sent)
        add("enqueue -> WAL append", s.get("write", 0) - s["enqueue"] if "write" in s else None)
        if "sync_start" in s:
            add("WAL append -> fsync starts (thread)", s["sync_start"] - s["write"])
            add("fsync", s["sync_end"] - s["sync_start"])
            add("fsync ends -> loop resumes", s["sync_done"] - s["sync_end"])
            add("loop resumes -> client has answer", received - s["sync_done"])
        elif "write" in s:
            add("WAL append -> client has answer", received - s["write"])
    return {name: _us(values) for name, values in legs.items()}


def fdatasync_us(directory: Path, count: int = 300) -> str:
    path = directory / "fdatasync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 300 * count)  # preallocated, as RocksDB's WAL is
    os.fsync(fd)
    took = []
    try:
        for index in range(count):
            os.pwrite(fd, b"x" * 300, 300 * index)
            started = time.perf_counter_ns()
            os.fdatasync(fd)
            took.append(time.perf_counter_ns() - started)
    finally:
        os.close(fd)
        path.unlink()
    return _us(took)


def pin(pid: int, cpu: int) -> None:
    if cpu >= 0:
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip


async def run_loops(addr: str, rounds: int) -> dict[str, list[Round]]:
    return {name: await loop(addr, rounds) for name, loop in LOOPS.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--server-cpu", type=int, default=1)
    parser.add_argument("--client-cpu", type=int, default=0)
    parser.add_argument(
        "--modes",
        default="buffer,sync",
        help="brokers to run, by persist mode (buffer, sync), in this order",
    )
    parser.add_argument("--no-echo", action="store_true", help="skip the echo server")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    if args.client_cpu >= 0:
        os.sched_setaffinity(0, {args.client_cpu})
    report = asyncio.run(measure(args))
    for title, legs in report.items():
        print(f"{title}:")
        for leg, value in legs.items():
            print(f"  {value} us  {leg}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


async def measure(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    report: dict[str, dict[str, str]] = {}
    if not args.no_echo:
        port = free_port()
        echo = await asyncio.create_subprocess_exec(sys.executable, __file__, "--serve", str(port))
        try:
            addr = f"127.0.0.1:{port}"
            await _ready(addr)
            pin(echo.pid, args.server_cpu)
            for name, rounds in (await run_loops(addr, args.rounds)).items():
                report[f"echo, {name}"] = echo_legs(rounds)
        finally:
            echo.terminate()
            await echo.wait()

    with tempfile.TemporaryDirectory(prefix="fila-roundtrip-") as tmp:
        report["fdatasync of 300 B, preallocated"] = {"fdatasync": fdatasync_us(Path(tmp))}
        for index, mode in enumerate(args.modes.split(",")):
            stamps_file = Path(tmp) / f"stamps-{index}.json"
            env = {"PYTHONPATH": str(PROBE), "ROUNDTRIP_STAMPS": str(stamps_file)}
            server = ServerProcess(Path(tmp) / f"data-{index}", persist_mode=mode, env=env)
            server.start()
            try:
                pin(server.pid, args.server_cpu)
                await _create_queue(server.addr)
                results = await run_loops(server.addr, args.rounds)
            finally:
                server.stop()
            stamps = json.loads(stamps_file.read_text())
            # The probe lists enqueues in arrival order, one loop after the other.
            offset = 0
            for name, rounds in results.items():
                per_loop = stamps[offset : offset + WARMUP + len(rounds)]
                offset += WARMUP + len(rounds)
                report[f"fila {mode} ({index}), {name}"] = broker_legs(rounds, per_loop)
    return report


async def _ready(addr: str) -> None:
    async with grpc.aio.insecure_channel(addr) as channel:
        await asyncio.wait_for(channel.channel_ready(), 20)


async def _create_queue(addr: str) -> None:
    async with AsyncClient(addr) as client:
        await client.create_queue(QUEUE)


if __name__ == "__main__":
    sys.exit(main())
