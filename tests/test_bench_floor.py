"""The latency floor (`fila_bench.floor`) does what a durable broker cannot skip.

The broker's light-load latency is reported as a ratio to this server's, measured
in the same run; a floor that answered before its data was synced, or lost or
reordered messages, would flatter or fail the comparison. Its own pieces run here
in-process, with the SDK's `AsyncClient` as the benchmark drives it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import grpc.aio
import pytest

from fila_bench.floor import Floor, FloorService, SyncedLog
from fila_bench.load import CheckFailed
from fila_sdk import AsyncClient


def test_each_enqueue_is_answered_after_a_sync_of_everything_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced_sizes: list[int] = []
    fdatasync = os.fdatasync

    def recording(fd: int) -> None:
        fdatasync(fd)
        synced_sizes.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fdatasync", recording)
    log_path = tmp_path / "log"

    async def scenario() -> None:
        log = SyncedLog(log_path, asyncio.get_running_loop())
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(FloorService(log).handlers())
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                await client.create_queue("q")
                ids = []
                for index in range(3):
                    ids.append(await client.enqueue("q", {"i": str(index)}, b"x" * 100))
                    written = log_path.stat().st_size
                    assert synced_sizes and synced_sizes[-1] == written, (
                        f"enqueue {index} answered with {written} bytes written and "
                        f"synced sizes {synced_sizes}"
                    )
                received = []
                async for message in client.consume("q"):
                    received.append((message.id, message.headers["i"], message.payload))
                    await client.ack("q", message.id)
                    if len(received) == 3:
                        break
                assert received == [(ids[i], str(i), b"x" * 100) for i in range(3)]
                assert log_path.stat().st_size > written  # the acks were logged too
                assert synced_sizes[-1] == log_path.stat().st_size  # and synced
        finally:
            await server.stop(None)
            log.close()
        assert log.syncs >= 3 + 1

    asyncio.run(scenario())


def test_a_floor_with_fewer_syncs_than_answers_fails_the_case() -> None:
    Floor("127.0.0.1:1", syncs=300).check_synced(300)
    with pytest.raises(CheckFailed, match="299 syncs for 300"):
        Floor("127.0.0.1:1", syncs=299).check_synced(300)
    with pytest.raises(CheckFailed):
        Floor("127.0.0.1:1").check_synced(1)  # never reported how many it did
