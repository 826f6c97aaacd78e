"""The reaper that trims RocksDB's obsolete files a chunk at a time (fila.storage.reaper).

What must hold: a file RocksDB still has is never touched, whatever else happens;
a file RocksDB deleted is trimmed and removed; what a dead broker left is reaped.
The first tests drive one step at a time on a real filesystem; the last ones run
the reaper's thread beside a real RocksDB that flushes and compacts.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from rocksdict import Rdict

from fila.storage.backend import Batch, RocksStorage, rocks_options
from fila.storage.reaper import CHUNK_BYTES, FileReaper
from tests.support import wait_until


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    db, deleting = tmp_path / "db", tmp_path / "deleting"
    db.mkdir()
    deleting.mkdir()
    return db, deleting


def _file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _run_reaper_until_gone(db: Path, deleting: Path, path: Path) -> None:
    """Runs a reaper's thread until the file at `path` is removed, then stops it.

    Gone means that inode no longer has that name: the reaper may link a live file of
    the database under the same name right after (as it should), so the name itself
    can come back."""
    reaped = _inode(path)
    reaper = FileReaper(db, deleting)
    assert reaper.start()
    try:
        wait_until(lambda: _inode(path) != reaped, 10, what=f"{path.name} reaped")
    finally:
        reaper.stop()


def test_only_tables_blobs_and_wal_files_are_linked(dirs: tuple[Path, Path]) -> None:
    db, deleting = dirs
    for name in ("000007.sst", "000008.log", "000009.blob", "MANIFEST-000005", "LOG", "CURRENT"):
        _file(db / name, 10)
    reaper = FileReaper(db, deleting)
    assert reaper.scan()
    assert sorted(p.name for p in deleting.iterdir()) == ["000007.sst", "000008.log", "000009.blob"]
    assert os.stat(db / "000007.sst").st_nlink == 2  # the same file, not a copy


def test_a_file_rocksdb_still_has_is_never_released(dirs: tuple[Path, Path]) -> None:
    db, deleting = dirs
    live = _file(db / "000010.sst", 3 * CHUNK_BYTES)
    content = live.read_bytes()
    reaper = FileReaper(db, deleting)
    reaper.scan()
    assert reaper.released() == []
    assert live.read_bytes() == content


def test_a_file_rocksdb_deleted_is_trimmed_a_chunk_at_a_time_then_removed(
    dirs: tuple[Path, Path],
) -> None:
    db, deleting = dirs
    _file(db / "000011.log", 2 * CHUNK_BYTES + 100)
    reaper = FileReaper(db, deleting)
    reaper.scan()
    (db / "000011.log").unlink()  # RocksDB lets go; the blocks stay, under our link
    assert reaper.released() == ["000011.log"]
    assert reaper.shrink("000011.log") is False
    assert os.stat(deleting / "000011.log").st_size == CHUNK_BYTES + 100
    assert reaper.shrink("000011.log") is False
    assert reaper.shrink("000011.log") is True
    assert not (deleting / "000011.log").exists()
    assert reaper.released() == []
    assert reaper.reaped_files == 1


def test_a_stale_link_with_a_reused_name_trims_only_the_old_file(dirs: tuple[Path, Path]) -> None:
    """After `--repair` the new database numbers its files from 1 again, so a link
    an earlier run left can carry the name of a live file that is another inode."""
    db, deleting = dirs
    _file(deleting / "000005.sst", 2 * CHUNK_BYTES)  # the old database's, released
    live = _file(db / "000005.sst", 3 * CHUNK_BYTES)
    content = live.read_bytes()
    _run_reaper_until_gone(db, deleting, deleting / "000005.sst")
    assert live.read_bytes() == content
    # The live file may be linked in its place by now, and then it is the same inode.
    assert _inode(deleting / "000005.sst") in (None, _inode(live))


def test_what_a_dead_broker_left_is_reaped_at_the_next_start(dirs: tuple[Path, Path]) -> None:
    db, deleting = dirs
    _file(deleting / "000003.log", 3 * CHUNK_BYTES)
    held = _file(db / "000004.sst", CHUNK_BYTES)
    os.link(held, deleting / "000004.sst")  # still RocksDB's: must stay
    _run_reaper_until_gone(db, deleting, deleting / "000003.log")
    assert (deleting / "000004.sst").exists() and held.exists()


def test_without_hard_links_deletion_is_left_to_rocksdb(tmp_path: Path) -> None:
    db = tmp_path / "db"
    db.mkdir()
    blocked = tmp_path / "deleting"
    blocked.write_text("a file where the directory would go")
    assert FileReaper(db, blocked).start() is False


def test_beside_real_rocksdb_obsolete_files_go_and_live_ones_stay_intact(tmp_path: Path) -> None:
    db_dir, deleting = tmp_path / "db", tmp_path / "deleting"
    db = Rdict(str(db_dir), options=rocks_options())
    reaper = FileReaper(db_dir, deleting)
    assert reaper.start()

    def all_linked() -> bool:  # every table and WAL file RocksDB has, linked by the reaper
        return all(p.stat().st_nlink == 2 for p in db_dir.iterdir() if p.suffix in (".sst", ".log"))

    def only_live_links_left() -> bool:
        return all(p.stat().st_nlink == 2 for p in deleting.iterdir())

    values = {b"k%03d" % i: os.urandom(64 * 1024) for i in range(96)}
    try:
        for round_ in range(3):  # three tables and three WAL files, then one compaction
            for key, value in values.items():
                db.put(key + b"-%d" % round_, value)
            # Each flush ends a WAL file; the reaper must see it before RocksDB deletes it.
            wait_until(all_linked, 5, what="reaper linked the new files")
            db.flush()
        db.compact_range(None, None)  # deletes the level-0 tables it merged
        wait_until(only_live_links_left, 20, what="every released file reaped")
        assert reaper.reaped_files >= 4  # WAL files and compacted tables
    finally:
        db.close()
        reaper.stop()
    reopened = Rdict(str(db_dir), options=rocks_options())
    try:
        for round_ in range(3):
            for key, value in values.items():
                assert reopened[key + b"-%d" % round_] == value
    finally:
        reopened.close()


def test_rocks_storage_paces_its_deletions(tmp_path: Path) -> None:
    storage = RocksStorage(tmp_path)
    try:
        assert storage.paced_deletion
        batch = Batch()
        batch.put(b"k", b"v")
        storage.write(batch)
        wait_until(lambda: list((tmp_path / "deleting").glob("*.log")), 5, what="WAL linked")
    finally:
        storage.close()


def test_a_trim_waits_while_the_wal_syncs(tmp_path: Path) -> None:
    """`quiet` is held by `RocksStorage.sync` for the whole fdatasync; a trim that
    overlapped it could hold the sync for tens of milliseconds (see the module)."""
    storage = RocksStorage(tmp_path / "broker")
    db, deleting = tmp_path / "db", tmp_path / "deleting"
    db.mkdir()
    deleting.mkdir()
    _file(deleting / "000001.log", 2 * CHUNK_BYTES)  # released: only our name
    reaper = FileReaper(db, deleting)
    try:
        with storage._reaper.quiet:  # what a sync in progress holds
            syncing = threading.Thread(target=storage.sync)
            syncing.start()
            syncing.join(0.2)
            assert syncing.is_alive()  # the sync takes the same lock
        syncing.join(5)
        assert not syncing.is_alive()
        with reaper.quiet:
            trimming = threading.Thread(target=reaper.shrink, args=("000001.log",))
            trimming.start()
            trimming.join(0.2)
            assert os.stat(deleting / "000001.log").st_size == 2 * CHUNK_BYTES
        trimming.join(5)
        assert os.stat(deleting / "000001.log").st_size == CHUNK_BYTES
    finally:
        storage.close()
