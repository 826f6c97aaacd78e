"""What a failed start looks like: a documented exit code and one line naming the cause.

Every way `fila-server` can fail to start (or to repair) ends with `fail`: one line on
stderr starting with `fila-server:`, the cause and the way out, and an `ExitCode`
(docs/operations.md lists them); never a traceback.
"""

from __future__ import annotations

import logging
import sys
from enum import IntEnum
from pathlib import Path

from fila.storage.backend import CorruptionError, RocksStorage, StorageError
from fila.storage.layout import upgrade_layout

log = logging.getLogger("fila.server")


class ExitCode(IntEnum):
    OK = 0
    STARTUP_FAILED = 1  # cannot listen, data directory unusable or in use, TLS files bad
    BAD_CONFIG = 2  # the configuration (file, environment, arguments) is invalid, or
    # names a cluster node id, address or data directory that another node holds
    STORAGE_FAILED = 3  # a write or sync failed while serving; the broker stopped
    DATA_DAMAGED = 4  # stored data failed its checksums; see `fila-server --repair`


class StartupError(Exception):
    """A reason the broker cannot start, worded for the operator."""

    def __init__(self, message: str, code: ExitCode = ExitCode.STARTUP_FAILED) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str, code: ExitCode) -> int:
    print(f"fila-server: {message}", file=sys.stderr)
    return int(code)


def open_storage(data_dir: Path, direct_io: bool) -> RocksStorage:
    """Opens the database and brings an older key layout up to date before anything reads it."""
    try:
        storage = RocksStorage(data_dir, direct_io=direct_io)
    except CorruptionError as exc:
        raise StartupError(str(exc), ExitCode.DATA_DAMAGED) from None
    except StorageError as exc:
        raise StartupError(str(exc)) from None
    try:
        moved = upgrade_layout(storage)
    except StorageError as exc:
        storage.close()
        damaged = isinstance(exc, CorruptionError)
        raise StartupError(
            f"upgrading the key layout of {data_dir}: {exc}",
            ExitCode.DATA_DAMAGED if damaged else ExitCode.STARTUP_FAILED,
        ) from None
    if moved:
        log.info("key layout upgraded", extra={"records_moved": moved})
    return storage
