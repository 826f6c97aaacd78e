"""`fila.storage.wal` reads the WAL RocksDB really writes, and skips only damaged bytes.

Each log here is written by a real RocksDB (rocksdict, the broker's engine options),
then read back; damage is a flipped byte, as a failing disk makes it. The repair's
replay of such a log is tested end to end in tests/test_storage_integrity.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rocksdict import Rdict, WriteBatch

from fila.storage import wal
from fila.storage.backend import rocks_options
from fila.storage.salvage import salvage


def _write_log(db_dir: Path, batches: list[list[tuple[bytes, bytes | None]]]) -> bytes:
    """The WAL file of a fresh database after `batches`, killed before any flush."""
    db = Rdict(str(db_dir), options=rocks_options())
    for operations in batches:
        batch = WriteBatch(raw_mode=True)
        for key, value in operations:
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        db.write(batch)
    db.flush_wal(True)
    (log,) = db_dir.glob("*.log")
    data = log.read_bytes()
    db.close()
    return data


def _batches(items: list[wal.Batch | wal.Skipped]) -> list[wal.Batch]:
    return [item for item in items if isinstance(item, wal.Batch)]


def _skipped(items: list[wal.Batch | wal.Skipped]) -> list[wal.Skipped]:
    return [item for item in items if isinstance(item, wal.Skipped)]


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 :]


def test_every_batch_reads_back_in_order_with_its_puts_and_deletes(tmp_path: Path) -> None:
    written = [[(b"k%d" % i, b"v%d" % i), (b"gone%d" % i, None)] for i in range(100)]
    items = list(wal.read_log(_write_log(tmp_path / "db", written)))
    assert _skipped(items) == []
    batches = _batches(items)
    assert [batch.operations for batch in batches] == written
    sequences = [batch.sequence for batch in batches]
    assert sequences == list(range(1, 201, 2))  # two operations: two sequence numbers each
    assert [batch.last_sequence for batch in batches] == [s + 1 for s in sequences]


def test_a_batch_larger_than_a_block_is_joined_from_its_fragments(tmp_path: Path) -> None:
    big = bytes(range(256)) * 400  # 100 KiB: FIRST, MIDDLE, MIDDLE, LAST
    written = [[(b"small", b"1")], [(b"big", big)], [(b"after", b"2")]]
    items = list(wal.read_log(_write_log(tmp_path / "db", written)))
    assert [batch.operations for batch in _batches(items)] == written


def test_a_damaged_record_costs_only_its_own_bytes(tmp_path: Path) -> None:
    written = [[(b"key-%03d" % i, b"value-%03d" % i)] for i in range(200)]
    data = _write_log(tmp_path / "db", written)
    target = data.index(b"key-050")
    items = list(wal.read_log(_flip(data, target)))
    (damage,) = _skipped(items)
    assert damage.offset < target < damage.offset + damage.bytes < target + 64
    assert damage.reason == "checksum mismatch"
    keys = [batch.operations[0][0] for batch in _batches(items)]
    assert keys == [b"key-%03d" % i for i in range(200) if i != 50]  # all the others


def test_damage_inside_a_fragmented_batch_loses_that_batch_only(tmp_path: Path) -> None:
    big = b"b" * 70_000
    written = [[(b"first", b"1")], [(b"big", big)], [(b"last", b"3")]]
    data = _write_log(tmp_path / "db", written)
    items = list(wal.read_log(_flip(data, data.index(b"b" * 100) + 40_000)))
    assert [batch.operations for batch in _batches(items)] == [written[0], written[2]]
    assert _skipped(items)


def test_a_batch_the_reader_does_not_understand_is_skipped_not_half_applied() -> None:
    merge = bytes([0x2, 1]) + b"k" + bytes([1]) + b"v"  # a merge: the broker never writes one
    batch = (7).to_bytes(8, "little") + (1).to_bytes(4, "little") + merge
    record = bytes([wal._FULL]) + batch
    header = wal.masked_crc(record).to_bytes(4, "little") + len(batch).to_bytes(2, "little")
    (item,) = wal.read_log(header + record)
    assert isinstance(item, wal.Skipped)
    assert "type 0x2" in item.reason


_CRASHING_WRITER = """
import os, sys
from pathlib import Path
from rocksdict import Rdict
from fila.storage.backend import rocks_options
db_dir = Path(sys.argv[1])
db = Rdict(str(db_dir), options=rocks_options())
db.put(b"acked", b"message")
db.put(b"kept", b"message")
db.delete(b"acked")
db.flush_wal(True)
(log,) = db_dir.glob("*.log")
Path(sys.argv[2]).write_bytes(log.name.encode() + b"\\n" + log.read_bytes())
db.flush()  # all of the above is in a table now, and RocksDB deletes that log
for name in (b"later-1", b"later-2", b"later-3"):
    db.put(name, b"message")
db.flush_wal(True)
os._exit(0)  # killed: no flush at close
"""


def test_repair_replays_only_what_the_tables_lack_and_says_what_was_lost(
    tmp_path: Path,
) -> None:
    """Damage in a log the tables already hold loses nothing, and replaying that
    log's older batches would bring a deleted key back; damage past the tables is
    reported lost, and the batches after it are kept."""
    data_dir = tmp_path / "data"
    db_dir = data_dir / "db"
    saved = tmp_path / "old-log"
    subprocess.run([sys.executable, "-c", _CRASHING_WRITER, str(db_dir), str(saved)], check=True)
    name, _, old_log = saved.read_bytes().partition(b"\n")
    delete_at = old_log.index(b"acked", old_log.index(b"kept"))
    (db_dir / name.decode()).write_bytes(_flip(old_log, delete_at))  # not deleted yet, say
    (live,) = [log for log in db_dir.glob("*.log") if log.name != name.decode()]
    live_log = live.read_bytes()
    live.write_bytes(_flip(live_log, live_log.index(b"later-2")))

    report = salvage(data_dir)

    assert [(s.file, s.lost) for s in report.skipped_wal] == [
        (name.decode(), False),
        (live.name, True),
    ]
    assert report.replayed_batches == 2
    db = Rdict(str(db_dir), options=rocks_options())
    try:
        assert db.get(b"acked") is None
        assert db.get(b"kept") == b"message"
        assert [db.get(b"later-%d" % i) for i in (1, 2, 3)] == [b"message", None, b"message"]
    finally:
        db.close()
