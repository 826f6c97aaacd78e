"""RocksStorage.write under a RocksDB write stall: refused writes are retried outside
the GIL, real errors still surface (see `RocksStorage.write`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fila.storage.backend import RocksStorage, StorageError


class _StallingDb:
    """Stands in for the Rdict: refuses `stalls` writes as RocksDB does with
    `no_slowdown`, then applies them to the real database."""

    def __init__(self, real: Any, stalls: int, error: str = "Result incomplete: Write stall"):
        self.real = real
        self.stalls = stalls
        self.error = error
        self.attempts = 0

    def write(self, batch: Any, options: Any) -> None:
        self.attempts += 1
        if self.attempts <= self.stalls:
            raise Exception(self.error)  # rocksdict raises plain Exception
        self.real.write(batch, options)


def test_the_write_options_refuse_to_stall(tmp_path: Path) -> None:
    storage = RocksStorage(tmp_path / "db")
    try:
        assert storage._write_options.no_slowdown is True
    finally:
        storage.close()


def test_a_stalled_write_is_retried_while_other_threads_run(tmp_path: Path) -> None:
    storage = RocksStorage(tmp_path / "db")
    stalling = _StallingDb(storage._db, stalls=40)
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
        batch = storage.new_batch()
        batch.put(b"k", b"v")
        storage.write(batch)
    finally:
        done.set()
        counter.join()
        storage._db = stalling.real
    try:
        assert stalling.attempts == 41
        assert storage.get(b"k") == b"v"
        assert ticks > 40  # the other thread ran between the attempts
    finally:
        storage.close()


def test_other_write_errors_are_storage_errors(tmp_path: Path) -> None:
    storage = RocksStorage(tmp_path / "db")
    stalling = _StallingDb(storage._db, stalls=1, error="IO error: No space left on device")
    storage._db = stalling  # type: ignore[assignment]
    try:
        batch = storage.new_batch()
        batch.put(b"k", b"v")
        with pytest.raises(StorageError, match="No space left"):
            storage.write(batch)
        assert stalling.attempts == 1
    finally:
        storage._db = stalling.real
        storage.close()
