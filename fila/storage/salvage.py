"""`fila-server --repair`: keep everything that is still readable, report the rest.

RocksDB's own repair drops a whole .sst file when one of its blocks fails its
checksum, which for a broker means losing thousands of good messages for one bad
block. So the salvage here copies the live data, key by key, into a fresh
database, and when the iterator stops at a damaged block it probes forward (an
exponential then binary search over the key space, which tells damaged blocks apart
by their errors) for the first key it can read again, losing only the damaged
blocks' keys, however many lie in one table. Because it copies the *merged* view,
a lost delete in a table can never resurrect an acknowledged message. When even
the tables do not open (a damaged MANIFEST), RocksDB's repair runs first to
rebuild the database from its files, then the salvage copies what that leaves.

A WAL record that fails its checksum before the log's tail (not a torn last
write, which the broker drops at startup) makes the database refuse to open.
The salvage then opens the tables alone and replays the WAL itself, record by
record (`fila.storage.wal`), skipping only the damaged bytes: RocksDB's recovery
would drop the rest of their 32 KiB block, its repair the rest of the log
file. Batches already in the tables are not replayed, so damage there costs
nothing. A damaged batch beyond them cannot be read, so it cannot be known: its
writes are lost, and an ack among them brings its message back (delivered
again: at least once, never lost). The report lists every skipped piece.

Opening a damaged database changes its directory (RocksDB writes a new MANIFEST;
its repair moves files to `lost/`), so the original files are kept first, as
second hard links, in `db.damaged-<time>`; nothing the operator had is deleted.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from rocksdict import Rdict, RdictIter, WriteBatch

from fila.storage import keys, wal
from fila.storage.backend import DataDirInUse, rocks_options

# Wider than any key the broker writes (queue names 259, config keys 1024 bytes).
_KEY_WIDTH = 1100
# The search's positions: a key up to _KEY_WIDTH bytes long as that many 9-bit digits
# (see `_position`), so _KEY_SPACE is one past the last position.
_DIGIT_BITS = 9
_POSITION_BITS = _DIGIT_BITS * _KEY_WIDTH
_KEY_SPACE = 1 << _POSITION_BITS
_DIGITS = [format(0x100 | byte, "09b") for byte in range(256)]
_FIRST_DIGITS = 32  # `_key` reads this many digits, then twice as many, until a zero one


@dataclass(frozen=True, slots=True)
class SkippedWal:
    """A piece of the write-ahead log that did not read back and was left out;
    `lost` is False when every write in it was already in the tables."""

    file: str
    offset: int
    bytes: int
    reason: str
    lost: bool


@dataclass(slots=True)
class SalvageReport:
    copied: int = 0
    damaged_regions: list[tuple[str, str]] = field(default_factory=list)
    skipped_wal: list[SkippedWal] = field(default_factory=list)
    replayed_batches: int = 0
    rebuilt_by_rocksdb: bool = False
    # tables RocksDB's repair could not read and left out: (name, bytes)
    lost_files: list[tuple[str, int]] = field(default_factory=list)
    kept_at: Path | None = None
    by_kind: dict[str, int] = field(default_factory=dict)


def salvage(data_dir: Path) -> SalvageReport:
    """Copies what is readable of `data_dir`'s database into a fresh one, in its place.

    Raises `DataDirInUse` if a broker holds the database, before anything changes."""
    report = SalvageReport()
    db_dir = data_dir / "db"
    _check_not_in_use(db_dir)
    kept = _unused(data_dir / f"db.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    _keep_originals(db_dir, kept)
    tables_dir = data_dir / "db.replaying"
    target_dir = data_dir / "db.salvaged"
    for leftover in (tables_dir, target_dir):  # a repair interrupted before its end
        shutil.rmtree(leftover, ignore_errors=True)
    source = _open_damaged(db_dir, tables_dir, report)
    target = Rdict(str(target_dir), options=rocks_options())
    try:
        _copy_readable(source, target, report)
        target.flush_wal(True)
    finally:
        target.close()
        source.close()
    # What is left in these is second names of the kept originals and the files this
    # salvage's opens wrote; the originals stay in `kept`.
    shutil.rmtree(tables_dir, ignore_errors=True)
    shutil.rmtree(db_dir)
    target_dir.rename(db_dir)
    report.kept_at = kept
    return report


def _check_not_in_use(db_dir: Path) -> None:
    """RocksDB's own lock, probed the way it takes it (a POSIX record lock on LOCK)."""
    try:
        fd = os.open(db_dir / "LOCK", os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise DataDirInUse(
                f"data directory {db_dir.parent} is in use by another fila-server "
                "(its LOCK file is held); stop that broker before repairing"
            ) from None
        raise
    finally:
        os.close(fd)  # releases the probe's lock


def _unused(path: Path) -> Path:
    """`path`, or `path` with the first free ".N" suffix (a second repair within the
    same second)."""
    candidate, number = path, 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.{number}")
        number += 1
    return candidate


# Files an open rewrites in place (the others it only adds or deletes): a hard link
# to them would not keep the damaged original.
_REWRITTEN_IN_PLACE = frozenset({"rocksdict-config.json"})


def _keep_originals(db_dir: Path, kept: Path) -> None:
    """Every file of the database as it is now, under `kept` (hard links; copies where
    the filesystem has none, or where the open rewrites the file in place)."""
    kept.mkdir()
    for source in db_dir.rglob("*"):
        destination = kept / source.relative_to(db_dir)
        if source.is_dir():
            destination.mkdir(exist_ok=True)
        elif source.name in _REWRITTEN_IN_PLACE:
            shutil.copy2(source, destination)
        else:
            _link_or_copy(source, destination)


def _open_damaged(db_dir: Path, tables_dir: Path, report: SalvageReport) -> Rdict:
    """Opens as much of the database as can be read: as it is; else its tables, with
    the WAL replayed around damaged records; else after RocksDB's repair (a damaged
    MANIFEST or table that the open itself reads)."""
    try:
        return Rdict(str(db_dir), options=rocks_options(create=False))
    except Exception:  # rocksdict raises plain Exception; damaged, so try harder
        pass
    tables_dir.mkdir()
    for source in db_dir.iterdir():
        if source.is_file() and not source.name.endswith(".log"):
            _link_or_copy(source, tables_dir / source.name)
    try:
        tables = Rdict(str(tables_dir), options=rocks_options(create=False))
    except Exception:
        Rdict.repair(str(db_dir), rocks_options())
        report.rebuilt_by_rocksdb = True
        # RocksDB's repair moves a table it cannot read to lost/ whole, and says nothing
        # (logs it turns into tables go there too: those are not lost).
        report.lost_files = sorted(
            (table.name, table.stat().st_size)
            for table in tables_dir.glob("*.sst")
            if not (db_dir / table.name).exists()
        )
        return Rdict(str(db_dir), options=rocks_options(create=False))
    try:
        _replay_wal(db_dir, tables, report)
    except BaseException:
        tables.close()
        raise
    return tables


def _replay_wal(db_dir: Path, tables: Rdict, report: SalvageReport) -> None:
    """Applies every whole WAL batch the tables do not hold yet, in log order.

    Sequence numbers grow from batch to batch, so a damaged span's writes came
    before the next whole batch's: if that batch's are in the tables, so are they."""
    in_tables: int = tables.latest_sequence_number()
    pending: list[tuple[str, wal.Skipped]] = []  # damage before the next whole batch
    logs = [path for path in db_dir.glob("*.log") if path.stem.isdigit()]
    for log_file in sorted(logs, key=lambda path: int(path.stem)):
        for item in wal.read_log(log_file.read_bytes()):
            if isinstance(item, wal.Skipped):
                pending.append((log_file.name, item))
                continue
            lost = item.sequence > in_tables + 1
            report.skipped_wal += [_skipped(name, damage, lost) for name, damage in pending]
            pending = []
            if item.last_sequence <= in_tables:
                continue
            batch = WriteBatch(raw_mode=True)
            for key, value in item.operations:
                if value is None:
                    batch.delete(key)
                else:
                    batch.put(key, value)
            tables.write(batch)
            report.replayed_batches += 1
    report.skipped_wal += [_skipped(name, damage, True) for name, damage in pending]


def _skipped(log_name: str, damage: wal.Skipped, lost: bool) -> SkippedWal:
    return SkippedWal(log_name, damage.offset, damage.bytes, damage.reason, lost)


def _link_or_copy(source: Path, destination: Path) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _copy_readable(source: Rdict, target: Rdict, report: SalvageReport) -> None:
    it = source.iter()
    it.seek_to_first()
    last = b""
    names = {
        keys.QUEUE: "queues",
        keys.MESSAGE: "messages",
        keys.LEASE: "leases",
        keys.DELAY: "delays",
        keys.CONFIG: "config",
        keys.API_KEY: "api keys",
        keys.ACL: "acls",
        keys.NODE: "cluster identity",
    }
    names.update({legacy: names[current] for legacy, current in keys.LEGACY_TAGS.items()})
    while True:
        while _valid(it):
            key = cast(bytes, it.key())
            target.put(key, cast(bytes, it.value()))
            kind = names.get(key[:1], "other")
            report.by_kind[kind] = report.by_kind.get(kind, 0) + 1
            report.copied += 1
            last = key
            it.next()
        if _ok(it):
            return  # the end, read cleanly
        resume = _next_readable(source, last)
        shown = resume.hex()[:40] if resume is not None else "end"
        report.damaged_regions.append((last.hex()[:40], shown))
        if resume is None:
            return
        it = source.iter()
        it.seek(resume)
        last = resume  # the next search starts past it, whatever this seek reads


def _valid(it: RdictIter) -> bool:
    return bool(it.valid())


def _ok(it: RdictIter) -> bool:
    try:
        it.status()
    except Exception:  # the iterator stopped on an error
        return False
    return True


def _position(key: bytes) -> int:
    """`key`'s place in the search: its bytes as 9-bit digits `0x100 | byte`, then zero
    digits up to the key width.

    One place per key, in byte order: a zero digit, lower than any byte's, ends a
    key, so `k` comes before `k + b"\\x00"` and both before `k + b"\\x01"`, and the
    successor of `k`'s place is `k + b"\\x00"`'s. The search used to pad the bytes
    themselves with zero bytes, which gave `k`, `k + b"\\x00"`, `k + b"\\x00\\x00"`...
    one place, and sought the padded key, past all of them: a readable
    `k + b"\\x00"` after a damaged block ending in `k` was lost, and so was the rest
    of such a chain of keys."""
    return int("".join([_DIGITS[byte] for byte in key]).ljust(_POSITION_BITS, "0"), 2)


def _key(position: int) -> bytes:
    """The first key, in byte order, whose place is at or after `position` (a seek
    there reads from the same key as a seek to that place would).

    A place whose digits stop being bytes at a zero digit with only zeros after it
    is the key of the bytes before it; with anything after it, it lies between that
    key and its successor, the key plus a zero byte. Only the leading digits are
    written out, as many as it takes to meet the first zero one (during a search
    about as many as the keys around it are long): writing out all 9,900 bits made a
    probe cost more than the seek itself (docs/benchmarks.md)."""
    digits = _FIRST_DIGITS
    while True:
        shift = _POSITION_BITS - digits * _DIGIT_BITS
        bits = format(position >> shift, f"0{digits * _DIGIT_BITS}b")
        length = bits[::_DIGIT_BITS].find("0")  # the first digit without its 0x100 bit
        if length >= 0 or digits == _KEY_WIDTH:
            break
        digits = min(2 * digits, _KEY_WIDTH)
    if length < 0:
        length = _KEY_WIDTH
    key = bytes(
        int(bits[start + 1 : start + _DIGIT_BITS], 2)
        for start in range(0, length * _DIGIT_BITS, _DIGIT_BITS)
    )
    rest = _POSITION_BITS - length * _DIGIT_BITS
    return key + b"\x00" if position & ((1 << rest) - 1) else key


def _next_readable(source: Rdict, after: bytes) -> bytes | None:
    """The first key past `after` at which a seek of `source` reads again (the key
    itself need not exist), or None when nothing readable follows.

    An exponential search forward, then a binary one back, finds *a* readable target,
    but not the first when damaged blocks lie in several places: a probe that fails
    says nothing of the span it jumped over, and with a readable block between two
    damaged ones the doubling step overshot it into the next damaged block, losing
    it whole (a table flipped in 10 places kept 422 of its 1001 keys, where point
    lookups still read 830). So the span between two failing probes is searched
    too, unless their errors show that no readable target lies between them (see
    `_Search.joined`), and the first readable target is kept.

    Every probe seeks a fresh iterator. One iterator remembers the block it last
    read, so the same seek could fail from one position and succeed from another:
    the search then settled on a target that failed again when the copy resumed
    there, and the repair looped forever (about one damaged file in twenty)."""
    search = _Search(source)
    start = _position(after) + 1  # the place of `after + b"\x00"`, its successor
    if start >= _KEY_SPACE:
        return None
    low = search.probe(start)
    step = 1
    while low.error is not None:
        target = low.target + step
        # past the widest key: the end, where a seek reads (nothing) without error
        probe = search.probe(target) if target < _KEY_SPACE else _Probe(_KEY_SPACE, None)
        if probe.error is not None and search.joined(low, probe):
            low, step = probe, step * 2
            continue
        found = search.first_readable(low, probe)
        if found is not None:
            return None if found.target >= _KEY_SPACE else _key(found.target)
        low, step = probe, step * 2
    return _key(low.target)


# RocksDB's message for a block that fails its checksum ends with where the block is.
_DAMAGED_BLOCK = re.compile(r" in (.+) offset (\d+) size (\d+)\s*$")
_BLOCK_TRAILER = 5  # after each table block: its compression type and checksum
# Probes one search may spend telling damaged blocks apart; past them it treats every
# two failures as one damaged span (the old search), so it always ends. The searches
# seen need far fewer (docs/benchmarks.md); this is for errors that never repeat.
_PROBE_BUDGET = 1_000_000


@dataclass(frozen=True, slots=True)
class _Probe:
    """A seek target and how a fresh iterator's seek there ended (None: it reads)."""

    target: int
    error: str | None


class _Search:
    """Probes of one search for the next readable target, counted against the budget."""

    def __init__(self, source: Rdict) -> None:
        self._source = source
        self.probes = 0

    def probe(self, target: int) -> _Probe:
        self.probes += 1
        it = self._source.iter()
        it.seek(_key(target))
        try:
            it.status()
        except Exception as exc:  # the seek stopped on an error
            return _Probe(target, str(exc))
        return _Probe(target, None)

    def joined(self, low: _Probe, high: _Probe) -> bool:
        """Whether every target between two failing probes fails too: their errors name
        the same block, or blocks next to each other in one table. A table's blocks lie
        in key order, so a seek between them lands in one of the two (in that table,
        which is enough to fail); the same message twice is the same block."""
        if self.probes > _PROBE_BUDGET:
            return True
        assert low.error is not None and high.error is not None
        if low.error == high.error:
            return True
        first, second = _DAMAGED_BLOCK.search(low.error), _DAMAGED_BLOCK.search(high.error)
        if first is None or second is None or first[1] != second[1]:
            return False
        offset, size = int(first[2]), int(first[3])
        return offset <= int(second[2]) <= offset + size + _BLOCK_TRAILER

    def first_readable(self, low: _Probe, high: _Probe) -> _Probe | None:
        """The first readable target after failing `low`, up to `high` (included if
        it reads), by bisection; a span between two failures not `joined` is searched
        before the one after it, so no readable block between them is missed."""
        later: list[tuple[_Probe, _Probe]] = []  # spans still to search, nearest last
        while True:
            if high.error is None:
                if high.target - low.target <= 1:
                    return high
            elif high.target - low.target <= 1 or self.joined(low, high):
                if not later:
                    return None
                low, high = later.pop()
                continue
            middle = self.probe((low.target + high.target) // 2)
            if middle.error is None:
                high = middle
            elif self.joined(low, middle):
                low = middle
            else:
                later.append((middle, high))
                high = middle
