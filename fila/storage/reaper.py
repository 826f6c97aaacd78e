"""Frees RocksDB's obsolete files a little at a time, so deleting one does not stall the WAL.

Why: on a filesystem mounted with online discard (ext4 `discard` on this project's
virtual disks), unlinking a file trims all its blocks in one go, and an fdatasync
of the WAL that arrives meanwhile waits for it. RocksDB deletes a WAL file after
every memtable flush and all the inputs of a compaction at once, right after a
burst, and those waits set the p99 of enqueues while RocksDB compacts. Truncating the
same file `CHUNK_BYTES` at a time costs a concurrent fdatasync little (figures,
measured with strace and perf trace on the broker: docs/benchmarks.md,
"Measurements behind design choices").

RocksDB's own remedy, the rate-limited deletion of `SstFileManager`, is not
reachable through rocksdict. So the reaper keeps a second hard link (in
`<data_dir>/deleting/`) to every table, blob and WAL file RocksDB creates. When
RocksDB deletes its name, the blocks stay allocated under ours, and the reaper
shrinks the file chunk by chunk, then unlinks it.

Trims never overlap the WAL's fsync: `RocksStorage.sync` runs inside `syncing`,
which holds `quiet`, and each trim takes it: without it, a series of trims held
both the WAL's fdatasync and a compaction's until the series ended. And each trim
follows the end of a sync, when the next one is furthest away (with no sync to
follow, one runs every `IDLE_TRIM_S`), which lowered the after-burst p99 further.

Safety rests on one check: a file is truncated only while our link is its only
name (`st_nlink == 1`). RocksDB never links an existing file, so once its name is
gone nothing can reach the inode but us. A file RocksDB still holds, a damaged
database kept aside by `--repair`, or any other name for it keeps it untouched.
Links left by a broker that died are reaped at the next start. A file RocksDB
creates and deletes between two scans is deleted the ordinary way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("fila.storage")

REAPED_SUFFIXES = (".sst", ".log", ".blob")  # tables, WAL files, blob files
CHUNK_BYTES = 1024 * 1024  # trimmed per truncate: a short discard (docs/benchmarks.md)
IDLE_TRIM_S = 0.002  # with no sync to follow, one trim this often: up to ~400 MiB/s
SCAN_INTERVAL_S = 0.02  # well under a WAL file's life: one memtable fill, even in a burst
_MTIME_TRUST_NS = 100_000_000  # well above the kernel's coarse clock tick


class FileReaper:
    """Links RocksDB's files as they appear; shrinks and removes them once RocksDB lets go.

    The reaper's own thread is the only owner of `deleting/`; `stop` ends it."""

    def __init__(self, db_dir: Path, deleting_dir: Path) -> None:
        self._db_dir = db_dir
        self._deleting_dir = deleting_dir
        self._linked: set[str] = set()  # names in deleting_dir, RocksDB's or not
        self._db_mtime_ns = -1
        self._scanned_ns = 0
        self._stop = threading.Event()
        # Held while the WAL syncs (by `RocksStorage.sync`) and for each trim: see the
        # module docstring.
        self.quiet = threading.Lock()
        self._synced = threading.Event()  # set by `syncing` as each sync ends
        self._thread: threading.Thread | None = None
        self.reaped_files = 0

    def start(self) -> bool:
        """Starts the thread; False (and ordinary deletion) where hard links are refused.

        Probed with a real link first: a reaper that linked some files and then
        failed would keep their space after RocksDB deleted them."""
        probe, second = self._deleting_dir / ".link-probe", self._deleting_dir / ".link-probe-2"
        try:
            self._deleting_dir.mkdir(exist_ok=True)
            for leftover in (probe, second):  # a broker killed mid-probe left them
                leftover.unlink(missing_ok=True)
            probe.touch()
            os.link(probe, second)
            second.unlink()
            probe.unlink()
            self._linked = {entry.name for entry in os.scandir(self._deleting_dir)}
        except OSError as exc:
            log.warning(
                "obsolete RocksDB files will be deleted at once, not paced",
                extra={"error": str(exc), "path": str(self._deleting_dir)},
            )
            return False
        self._thread = threading.Thread(target=self._run, name="fila-reaper", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Ends the thread, then removes at once what RocksDB no longer holds (shutdown
        has no probe to protect; whatever is left is reaped at the next start)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        try:
            for name in self.released():
                self._unlink(name)
        except OSError as exc:
            log.warning("could not remove obsolete RocksDB files", extra={"error": str(exc)})

    @contextmanager
    def syncing(self) -> Iterator[None]:
        """Held around each WAL sync: no trim runs meanwhile, and the next trim follows
        the sync's end, the moment furthest from the next sync."""
        with self.quiet:
            yield
        self._synced.set()

    def scan(self) -> bool:
        """Links every new table, blob and WAL file of the database into `deleting/`;
        True if the directory changed since the last scan (RocksDB created or deleted).

        Skipped while the directory is unchanged (its mtime moves on every create and
        unlink), so an idle broker costs one stat per interval. The mtime has the
        kernel's coarse clock, so a change within `_MTIME_TRUST_NS` of the last scan
        is not trusted to be seen yet."""
        mtime_ns = os.stat(self._db_dir).st_mtime_ns
        if mtime_ns == self._db_mtime_ns and self._scanned_ns - mtime_ns > _MTIME_TRUST_NS:
            return False
        self._db_mtime_ns = mtime_ns
        self._scanned_ns = time.time_ns()
        for entry in os.scandir(self._db_dir):
            name = entry.name
            if name in self._linked or not name.endswith(REAPED_SUFFIXES):
                continue
            try:
                os.link(entry.path, self._deleting_dir / name)
            except FileNotFoundError:
                continue  # RocksDB deleted it already, the ordinary way
            except FileExistsError:
                pass  # an earlier run's link; its inode's links are counted before any trim
            self._linked.add(name)
        return True

    def released(self) -> list[str]:
        """Linked files whose only name is ours: RocksDB has deleted them."""
        released = []
        for name in sorted(self._linked):
            try:
                links = os.stat(self._deleting_dir / name).st_nlink
            except FileNotFoundError:
                self._linked.discard(name)
                continue
            if links == 1:
                released.append(name)
        return released

    def shrink(self, name: str) -> bool:
        """Trims one chunk off the end of released file `name`; True once it is gone."""
        path = self._deleting_dir / name
        with self.quiet:
            size = os.stat(path).st_size
            if size <= CHUNK_BYTES:
                self._unlink(name)
                return True
            os.truncate(path, size - CHUNK_BYTES)
        return False

    def _unlink(self, name: str) -> None:
        path = self._deleting_dir / name
        path.unlink(missing_ok=True)
        self._linked.discard(name)
        self.reaped_files += 1

    def _run(self) -> None:
        changed = True  # look for what an earlier run left, too
        last_error = ""
        while not self._stop.is_set():
            try:
                changed = self.scan() or changed
                while changed:  # RocksDB may delete more while we trim
                    changed = False
                    for name in self.released():
                        while not self.shrink(name):
                            self._synced.wait(IDLE_TRIM_S)
                            self._synced.clear()
                            if self._stop.is_set():
                                return
                            changed = self.scan() or changed  # link what RocksDB creates
            except Exception as exc:  # a dead reaper would keep every deleted file's space
                changed, self._db_mtime_ns = True, -1  # look again, all of it
                if str(exc) != last_error:  # once per distinct failure, not every interval
                    last_error = str(exc)
                    log.warning("pacing RocksDB's deletions failed", extra={"error": last_error})
            self._stop.wait(SCAN_INTERVAL_S)
