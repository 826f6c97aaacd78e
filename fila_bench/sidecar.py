"""Reference servers the benchmark runs beside the broker: the echo ceiling
(`fila_bench.echo`) and the latency floor (`fila_bench.floor`).

Each is a child process, `python -m <module> PORT [ARGS...]`, pinned like a broker
once it serves, that runs until its stdin closes: the benchmark cannot leave one
behind, whichever way it ends. What the child prints to stdout before it exits is
kept for the caller (the floor reports how many syncs it did).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import grpc.aio

from fila.testing.children import free_port
from fila_bench.cpus import pin_process

_READY_TIMEOUT_S = 20.0
_EXIT_TIMEOUT_S = 10.0


@dataclass
class Sidecar:
    addr: str
    output: str | None = None  # its stdout, once it has exited


@asynccontextmanager
async def sidecar(
    module: str, args: list[str], server_cpus: frozenset[int] | None
) -> AsyncIterator[Sidecar]:
    """Starts `module` on a free port and waits until it serves; on exit closes its
    stdin, waits for it (killing it after 10 s) and keeps what it printed."""
    port = free_port()
    proc = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", module, str(port), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    server = Sidecar(f"127.0.0.1:{port}")
    try:
        async with asyncio.timeout(_READY_TIMEOUT_S):
            channel = grpc.aio.insecure_channel(server.addr)
            await channel.channel_ready()
            await channel.close(None)
        if server_cpus is not None:  # once serving, so its threads exist to be pinned
            pin_process(proc.pid, server_cpus)
        yield server
    finally:
        try:
            out, _ = await asyncio.to_thread(proc.communicate, None, _EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = await asyncio.to_thread(proc.communicate)
        server.output = out


async def until_stdin_closes() -> None:
    """For the child: returns once the benchmark that started it closes its stdin."""
    closed = asyncio.Event()

    def on_stdin() -> None:
        if not os.read(sys.stdin.fileno(), 4096):
            closed.set()

    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), on_stdin)
    try:
        await closed.wait()
    finally:
        loop.remove_reader(sys.stdin.fileno())
