"""The key-value store under the broker, behind the small interface the core depends on.

The broker needs five things from storage: read one key, scan a key prefix in
order, apply a batch of puts and deletes atomically, make everything applied so
far durable, and close. `Storage` names exactly that. `RocksStorage` is the
production engine; `MemoryStorage` keeps the same contract in a dict so the core
can be exercised in-process, deterministically, without a server or a disk.

Corruption is never silent. RocksDB verifies block checksums on every read (and
`paranoid_checks` at open), but rocksdict's plain iteration simply *stops* at a
bad block: a scan that ends early looks exactly like a scan that reached the
end, and recovery would then rebuild a broker with messages missing. So every
scan here drives the raw iterator and checks its status at the end, raising
`CorruptionError`. The WAL is replayed with `tolerate_corrupted_tail_records`:
a record torn by a power loss at the very end of the log is dropped (it was
never acknowledged), but damage anywhere else refuses to open instead of
truncating the log there, which would silently drop acknowledged writes.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import mmap
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, cast

from rocksdict import (
    DBRecoveryMode,
    Env,
    Options,
    Rdict,
    RdictIter,
    ReadOptions,
    WriteBatch,
    WriteOptions,
)

from fila.storage.keys import prefix_end
from fila.storage.reaper import FileReaper

_WRITE_STALL = "Write stall"  # RocksDB's Status::Incomplete text for a refused write
_STALL_RETRY_MIN_S = 0.0005
_STALL_RETRY_MAX_S = 0.01
_DIRECT_IO_BLOCK = 4096  # a multiple of every logical block size O_DIRECT may demand


class StorageError(Exception):
    """A write or sync failed; the broker stops rather than diverge from its disk."""


class CorruptionError(StorageError):
    """Stored data failed a checksum or could not be read back."""


class DataDirInUse(StorageError):
    """Another process (another broker) holds the data directory's lock."""


class Batch:
    """Puts and deletes in order, applied atomically by `Storage.write`.

    A plain list of operations rather than rocksdict's `WriteBatch`: rocksdict
    consumes a `WriteBatch` even when RocksDB refuses the write (a write stall), so
    the retry in `RocksStorage.write` needs the operations again. With the
    `WriteBatch` kept, the first stall of a burst stopped the broker ("this batch is
    already consumed"; docs/benchmarks.md, "Measurements behind design choices").
    """

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: list[tuple[bytes, bytes | None]] = []  # (key, value); None deletes

    def put(self, key: bytes, value: bytes) -> None:
        self.ops.append((key, value))

    def delete(self, key: bytes) -> None:
        self.ops.append((key, None))


class Storage(Protocol):
    """What the broker needs from a key-value store; see the module docstring."""

    def get(self, key: bytes) -> bytes | None: ...

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) with `prefix`, in key order, from `start` (inclusive) if given.
        Raises CorruptionError if the scan could not read everything."""
        ...

    def write(self, batch: Batch) -> None:
        """Applies `batch` atomically, without waiting for the disk."""
        ...

    def sync(self) -> None:
        """Makes every write so far durable. May run on another thread."""
        ...

    def view(self) -> StorageView:
        """The store as it is now, to read while writes go on (cluster replication
        sends a queue's state as of one moment)."""
        ...

    def close(self) -> None: ...


class StorageView(Protocol):
    """A consistent read of the store as it was when the view was taken; its scans
    run one after another (each one ends before the next begins)."""

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """As `Storage.scan`, as of the view's moment."""
        ...


# RocksDB's own messages name the file; keep them, they tell the operator where to look.
_LOCK_HELD = re.compile(r"lock", re.IGNORECASE)


class RocksStorage:
    """RocksDB through rocksdict, with checksums enforced and scans that report damage."""

    def __init__(self, data_dir: Path, direct_io: bool = True) -> None:
        """`direct_io`: write tables with O_DIRECT if the filesystem takes it (see
        `rocks_options`); `self.direct_io` says whether they are."""
        self.path = data_dir / "db"
        try:
            data_dir.mkdir(parents=True, exist_ok=True)
            self.direct_io = direct_io and supports_direct_io(data_dir)
            damaged = missing_current(self.path)
        except OSError as exc:
            # A path under a file, a read-only or full filesystem, no permission: the
            # operator's to fix, so one line naming the directory, not a traceback.
            raise StorageError(
                f"cannot use data directory {data_dir}: {exc.strerror or exc}; set "
                "storage.data_dir or FILA_DATA_DIR to a directory the broker can write"
            ) from None
        if damaged:
            raise CorruptionError(
                f"data in {self.path} is damaged: its CURRENT file, which names the live "
                "MANIFEST, is missing. The broker refuses to start rather than begin an "
                "empty database there (which would delete every table); see "
                "`fila-server --repair` in docs/operations.md"
            )
        try:
            self._db = Rdict(str(self.path), options=rocks_options(direct_io=self.direct_io))
        except Exception as exc:  # rocksdict raises plain Exception for every open failure
            raise _open_error(self.path, exc) from None
        read = ReadOptions()
        read.set_verify_checksums(True)
        self._read_options = read
        self._db.set_read_options(read)
        self._write_options = WriteOptions()
        self._write_options.sync = False
        # A write RocksDB would stall (memtables full, too many level-0 files) fails at
        # once instead; `write` waits outside it. See `write`.
        self._write_options.no_slowdown = True
        # Obsolete files are trimmed a chunk at a time instead of unlinked whole (see
        # fila.storage.reaper); `self.paced_deletion` says whether they are.
        self._reaper = FileReaper(self.path, data_dir / "deleting")
        self.paced_deletion = self._reaper.start()

    def get(self, key: bytes) -> bytes | None:
        try:
            return cast(bytes | None, self._db.get(key))
        except Exception as exc:  # a checksum mismatch surfaces as a plain Exception
            raise CorruptionError(f"reading key {key[:1]!r}...: {exc}") from None

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        end = prefix_end(prefix)
        it = self._db.iter(self._read_options)
        it.seek(start if start is not None and start > prefix else prefix)
        while it.valid():
            key = cast(bytes, it.key())
            if key >= end:
                return
            yield key, cast(bytes, it.value())
            it.next()
        try:
            it.status()
        except Exception as exc:  # the iterator stopped on an error, not at the end
            raise CorruptionError(f"scanning {prefix!r} records: {exc}") from None

    def write(self, batch: Batch) -> None:
        """Applies `batch` (unsynced; `sync` makes it durable).

        rocksdict holds the GIL for the whole of a write, so a write RocksDB stalls
        (while flushes catch up with a burst) froze every thread of the broker, the
        event loop included, for as long as the stall lasted. With
        `no_slowdown` RocksDB refuses such a write at once, untouched ("Write stall");
        it is retried after a sleep that releases the GIL, so only the writers wait.
        """
        wait_s = _STALL_RETRY_MIN_S
        while True:
            try:
                self._db.write(_rocks_batch(batch), self._write_options)
                return
            except Exception as exc:  # rocksdict raises plain Exception on I/O errors
                if _WRITE_STALL not in str(exc):
                    raise StorageError(f"write failed: {exc}") from None
            time.sleep(wait_s)
            wait_s = min(2 * wait_s, _STALL_RETRY_MAX_S)

    def sync(self) -> None:
        """fsyncs the WAL; `flush_wal(True)` releases the GIL while the disk works. No
        trim of an obsolete file runs meanwhile (see fila.storage.reaper)."""
        try:
            with self._reaper.syncing():
                self._db.flush_wal(True)
        except Exception as exc:  # rocksdict raises plain Exception on I/O errors
            raise StorageError(f"WAL sync failed: {exc}") from None

    def view(self) -> StorageView:
        """One RocksDB iterator made now: it reads the state of its creation, whatever
        is written later (rocksdict's `Snapshot` iterates the live database instead)."""
        return _RocksView(self._db.iter(self._read_options))

    def property_int(self, name: str) -> int | None:
        value = self._db.property_int_value(name)
        return None if value is None else int(value)

    def close(self) -> None:
        try:
            self._db.close()
        except Exception as exc:  # e.g. the write error that stopped the broker, again
            raise StorageError(f"closing the database: {exc}") from None
        finally:
            self._reaper.stop()


class _RocksView:
    __slots__ = ("_it",)

    def __init__(self, it: RdictIter) -> None:
        self._it = it

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        end = prefix_end(prefix)
        it = self._it
        it.seek(start if start is not None and start > prefix else prefix)
        while it.valid():
            key = cast(bytes, it.key())
            if key >= end:
                return
            yield key, cast(bytes, it.value())
            it.next()
        try:
            it.status()
        except Exception as exc:  # the iterator stopped on an error, not at the end
            raise CorruptionError(f"scanning {prefix!r} records: {exc}") from None


def rocks_options(direct_io: bool = False, *, create: bool = True) -> Options:
    """The engine settings, in one place (see docs/operations.md for the reasons).
    `create`: make a new database where there is none (never where one is damaged).

    - `paranoid_checks`: verify what RocksDB reads at open instead of trusting it.
    - WAL recovery refuses damage before the tail (see the module docstring).
    - Background flushes and compactions get their own threads (2 jobs) at the
      lowest I/O priority (compactions also the lowest CPU priority), so they yield
      the disk and the event loop's core to the WAL and to requests.
    - No rate limit on flushes and compactions: one (64 MiB/s) made a burst outrun
      its flushes, and RocksDB then stopped all writes until a memtable was flushed,
      so enqueues waited seconds during the burst and long after it.
    - Tables are written 256 KiB at a time (RocksDB's default is 1 MiB): with
      O_DIRECT each piece is one request the WAL's small writes may queue behind, and
      smaller pieces kept the p99 during and after a burst closer to rest; 128 and
      64 KiB made the compactions after the burst longer.
    - 32 MiB memtables, up to 4, and a larger level-0 slowdown trigger keep write
      stalls away under a sustained burst.
    - With `direct_io` (where the filesystem allows O_DIRECT; see
      `supports_direct_io`), flushes and compactions write their tables around the
      page cache. Buffered, right after a burst, the WAL's fdatasync waited while
      tables were written, and an enqueue's p99 with it; with O_DIRECT far less. The
      figures for these choices: docs/benchmarks.md, "Measurements behind design
      choices" (`fila-bench system --only compaction`). Our reading:
      buffered table pages are written back by the kernel's flusher threads, in
      bursts and outside the idle I/O priority given to RocksDB's threads, and the
      WAL's small writes queue behind them; O_DIRECT writes leave from those
      threads, at that priority, in 1 MiB pieces. The price: fresh tables are not
      in the page cache, so a backlog drained at once reads them from the disk
      (`storage.direct_io = false` trades back; docs/operations.md, "The disk").
    """
    options = Options(raw_mode=True)
    options.create_if_missing(create)
    options.set_paranoid_checks(True)
    options.set_wal_recovery_mode(DBRecoveryMode.tolerate_corrupted_tail_records())
    options.set_max_background_jobs(2)
    options.set_write_buffer_size(32 * 1024 * 1024)
    options.set_max_write_buffer_number(4)
    options.set_level_zero_slowdown_writes_trigger(30)
    options.set_level_zero_stop_writes_trigger(48)
    options.set_bytes_per_sync(1024 * 1024)
    options.set_use_direct_io_for_flush_and_compaction(direct_io)
    options.set_writable_file_max_buffer_size(256 * 1024)
    options.set_env(_background_env())
    # The broker holds at most a few hundred files open; never let RocksDB take every
    # descriptor the process has (see fila.server.limits).
    options.set_max_open_files(512)
    return options


def missing_current(db_dir: Path) -> bool:
    """Whether `db_dir` holds a database's files but not CURRENT. RocksDB would take
    it for a new database, write an empty one over it, and delete every table as
    obsolete at the next open."""
    if not db_dir.is_dir() or (db_dir / "CURRENT").exists():
        return False
    return any(
        path.name.startswith("MANIFEST-") or path.suffix in (".sst", ".log")
        for path in db_dir.iterdir()
    )


def supports_direct_io(directory: Path) -> bool:
    """Whether files in `directory` take O_DIRECT writes (tmpfs before Linux 6.6 and
    some network filesystems refuse them).

    Probed with a real aligned write, because RocksDB finds out only when a flush
    opens its first table, and a flush that fails stops every write of the broker."""
    direct: int | None = getattr(os, "O_DIRECT", None)
    if direct is None:
        return False  # not a Linux-like platform
    probe = directory / ".direct-io-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        try:
            with mmap.mmap(-1, _DIRECT_IO_BLOCK) as aligned:  # page-aligned, as O_DIRECT needs
                os.write(fd, aligned)
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        # Best effort: on a read-only filesystem the unlink fails too (EROFS, even for a
        # file that was never created), and a probe that cannot be removed is no reason
        # to stop; a directory the broker cannot write is reported by the open that
        # follows, in one line.
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return True


def _rocks_batch(batch: Batch) -> WriteBatch:
    """A fresh rocksdict `WriteBatch` of `batch`'s operations (each write consumes one)."""
    rocks = WriteBatch(raw_mode=True)
    put, delete = rocks.put, rocks.delete
    for key, value in batch.ops:
        if value is None:
            delete(key)
        else:
            put(key, value)
    return rocks


def _background_env() -> Env:
    """RocksDB's background threads at the lowest CPU and I/O priority.

    On a small machine a compaction thread competes with the event loop for a core;
    flushes and compactions can wait a little, a probe's answer should not."""
    env = Env()
    env.lower_thread_pool_cpu_priority()
    env.lower_thread_pool_io_priority()
    env.lower_high_priority_thread_pool_io_priority()
    return env


def _open_error(path: Path, exc: Exception) -> StorageError:
    text = str(exc)
    if (
        "LOCK" in text
        and _LOCK_HELD.search(text)
        and ("temporarily unavailable" in text or "lock hold" in text.lower())
    ):
        return DataDirInUse(
            f"data directory {path.parent} is in use by another fila-server "
            "(its LOCK file is held); stop that broker or choose another data_dir"
        )
    text = " ".join(text.split())  # RocksDB's messages may span lines; ours is one
    manifest_gone = "MANIFEST" in text and "No such file" in text  # CURRENT names it
    if "Corruption" in text or "checksum" in text.lower() or manifest_gone:
        return CorruptionError(
            f"data in {path} is damaged: {text}. The broker refuses to start rather than "
            f"lose acknowledged messages; see `fila-server --repair` in docs/operations.md"
        )
    if isinstance(exc, OSError) and exc.errno == errno.EACCES:
        return StorageError(f"cannot open {path}: permission denied")
    return StorageError(f"cannot open {path}: {text}")


class MemoryStorage:
    """`Storage` in a dict: the same contract, for fast in-process tests of the core.

    `sync_count` counts syncs so a test can see that an answer waited for one.
    """

    def __init__(self) -> None:
        self._data: dict[bytes, bytes] = {}
        self._sorted: list[bytes] | None = []
        self.sync_count = 0
        self.writes = 0

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        if self._sorted is None:
            self._sorted = sorted(self._data)
        keys = self._sorted
        end = prefix_end(prefix)
        i = bisect.bisect_left(keys, start if start is not None and start > prefix else prefix)
        snapshot = keys[i : bisect.bisect_left(keys, end)]
        for key in snapshot:
            value = self._data.get(key)
            if value is not None:
                yield key, value

    def write(self, batch: Batch) -> None:
        for key, value in batch.ops:
            if value is None:
                if self._data.pop(key, None) is not None:
                    self._sorted = None
            else:
                if key not in self._data:
                    self._sorted = None
                self._data[key] = value
        self.writes += 1

    def sync(self) -> None:
        self.sync_count += 1

    def view(self) -> StorageView:
        return _MemoryView(dict(self._data))

    def close(self) -> None:
        pass

    def __len__(self) -> int:
        return len(self._data)


class _MemoryView:
    __slots__ = ("_data", "_keys")

    def __init__(self, data: dict[bytes, bytes]) -> None:
        self._data = data
        self._keys = sorted(data)

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        keys = self._keys
        end = prefix_end(prefix)
        i = bisect.bisect_left(keys, start if start is not None and start > prefix else prefix)
        for key in keys[i : bisect.bisect_left(keys, end)]:
            yield key, self._data[key]


__all__ = [
    "Batch",
    "CorruptionError",
    "DataDirInUse",
    "MemoryStorage",
    "RocksStorage",
    "Storage",
    "StorageError",
    "StorageView",
]
