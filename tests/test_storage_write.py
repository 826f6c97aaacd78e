"""RocksStorage.write under a RocksDB write stall: refused writes are retried outside
the GIL, real errors still surface (see `RocksStorage.write`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from rocksdict import Options, Rdict

from fila.storage.backend import Batch, RocksStorage, StorageError


class _StallingDb:
    """Stands in for the Rdict: refuses `stalls` writes as RocksDB does with
    `no_slowdown`, then applies them to the real database.

    A refused write still consumes its `WriteBatch`, as rocksdict does: the batch
    goes to a scratch database (a real Rdict), so a retry that reused it would fail
    with rocksdict's own "already consumed" error, as the broker once did."""

    def __init__(
        self, real: Any, scratch: Path, stalls: int, error: str = "Result incomplete: Write stall"
    ):
        self.real = real
        self.scratch = Rdict(str(scratch), options=Options(raw_mode=True))
        self.stalls = stalls
        self.error = error
        self.attempts = 0

    def write(self, batch: Any, options: Any) -> None:
        self.attempts += 1
        if self.attempts <= self.stalls:
            self.scratch.write(batch)  # consumed, as by the refused write
            raise Exception(self.error)  # rocksdict raises plain Exception
        self.real.write(batch, options)

    def close(self) -> None:
        self.scratch.close()


def test_the_write_options_refuse_to_stall(tmp_path: Path) -> None:
    storage = RocksStorage(tmp_path / "db")
    try:
        assert storage._write_options.no_slowdown is True
    finally:
        storage.close()


def test_a_stalled_write_is_retried_while_other_threads_run(tmp_path: Path) -> None:
    storage = RocksStorage(tmp_path / "db")
    stalling = _StallingDb(storage._db, tmp_path / "scratch", stalls=40)
    storage._db = stalling  # type: ignore[assignment]
    ticks = 0
    done = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        batch = Batch()
        batch.put(b"k", b"v")
        batch.put(b"gone", b"x")
        batch.delete(b"gone")
        storage.write(batch)
    finally:
        done.set()
        counter.join()
        storage._db = stalling.real
        stalling.close()
    try:
        assert stalling.attempts == 41
        assert storage.get(b"k") == b"v"
        assert storage.get(b"gone") is None  # the operations kept their order
        assert ticks > 40  # the other thread ran between the attempts
    finally:
        storage.close()


def test_other_write_errors_are_storage_errors(tmp_path: Path) -> None:
    storage = RocksStorage(tmp_path / "db")
    stalling = _StallingDb(
        storage._db, tmp_path / "scratch", stalls=1, error="IO error: No space left on device"
    )
    storage._db = stalling  # type: ignore[assignment]
    try:
        batch = Batch()
        batch.put(b"k", b"v")
        with pytest.raises(StorageError, match="No space left"):
            storage.write(batch)
        assert stalling.attempts == 1
    finally:
        storage._db = stalling.real
        stalling.close()
        storage.close()
