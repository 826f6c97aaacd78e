"""RocksDB access and the group committer every state change goes through.

Why one committer: an fsync costs about 0.2 ms here, and RocksDB writes through
rocksdict hold the GIL for their whole duration, fsync included. Writing each
request on its own would cap durable throughput at one fsync per request and
stall the event loop each time. Instead, every write made during one turn of the
event loop lands in a single `WriteBatch`, written once (with `sync=True` in
``sync`` mode) from a callback scheduled with `call_soon`. While that write
blocks, new requests queue up inside gRPC and form the next batch, so batch size
grows with load and the per-request fsync cost shrinks (group commit).

Writers never wait on each other: they add their operations to the open batch
and await `Committer.flushed()`, a future shared by everything in that batch.
Work that must only happen once a write is durable (a message becoming
deliverable) registers with `after_commit`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from rocksdict import Options, Rdict, WriteBatch, WriteOptions

from fila.storage.keys import prefix_end

log = logging.getLogger("fila.storage")

PersistMode = Literal["sync", "buffer"]


class StorageError(Exception):
    """A write could not be made durable; the broker stops rather than diverge from disk."""


def open_db(data_dir: Path) -> Rdict:
    data_dir.mkdir(parents=True, exist_ok=True)
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    return Rdict(str(data_dir / "db"), options=options)


def scan(db: Rdict, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Yields every (key, value) whose key starts with `prefix`, in key order."""
    end = prefix_end(prefix)
    for key, value in db.items(from_key=prefix):
        if key >= end:
            break
        yield key, value


class Committer:
    """Collects writes into one open batch and commits it once per event-loop turn."""

    def __init__(
        self,
        db: Rdict,
        mode: PersistMode,
        on_failure: Callable[[StorageError], None],
    ) -> None:
        self._db = db
        self._write_options = WriteOptions()
        self._write_options.sync = mode == "sync"
        self._on_failure = on_failure
        self._batch = WriteBatch(raw_mode=True)
        self._ops = 0
        self._future: asyncio.Future[None] | None = None
        self._after: list[Callable[[], None]] = []
        self._scheduled = False
        self._failed: StorageError | None = None
        self.batches_written = 0
        self.ops_written = 0

    def put(self, key: bytes, value: bytes) -> None:
        self._batch.put(key, value)
        self._touch()

    def delete(self, key: bytes) -> None:
        self._batch.delete(key)
        self._touch()

    def delete_range(self, begin: bytes, end: bytes) -> None:
        self._batch.delete_range(begin, end)
        self._touch()

    def flushed(self) -> asyncio.Future[None]:
        """A future that resolves once everything written so far is committed."""
        if self._failed is not None:
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(self._failed)
            return failed
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            self._schedule()
        return self._future

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Runs `callback` on the event loop once the open batch is committed."""
        self._after.append(callback)
        self._schedule()

    def flush_now(self) -> None:
        """Commits the open batch synchronously (startup, recovery and shutdown)."""
        self._commit()

    def _touch(self) -> None:
        self._ops += 1
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._commit)

    def _commit(self) -> None:
        self._scheduled = False
        batch, ops, future, after = self._batch, self._ops, self._future, self._after
        self._batch = WriteBatch(raw_mode=True)
        self._ops = 0
        self._future = None
        self._after = []
        if self._failed is None and ops:
            try:
                self._db.write(batch, self._write_options)
            except Exception as exc:  # rocksdict raises plain Exception on I/O errors
                self._failed = StorageError(f"storage write failed: {exc}")
                log.critical("storage write failed, stopping: %s", exc)
                self._on_failure(self._failed)
            else:
                self.batches_written += 1
                self.ops_written += ops
        if self._failed is not None:
            if future is not None and not future.done():
                future.set_exception(self._failed)
                future.exception()  # mark retrieved: every waiter reports it itself
            return
        for callback in after:
            callback()
        if future is not None and not future.done():
            future.set_result(None)
