"""`fila-server --repair`: keep everything that is still readable, report the rest.

RocksDB's own repair drops a whole .sst file when one of its blocks fails its
checksum, which for a broker means losing thousands of good messages for one bad
block. So the salvage here copies the live data, key by key, into a fresh
database, and when the iterator stops at a damaged block it probes forward (an
exponential then binary search over the key space) for the first key it can read
again, losing only the damaged block's keys. Because it copies the *merged* view,
a lost delete can never resurrect an acknowledged message. When the database does
not even open (a damaged WAL or MANIFEST), RocksDB's repair runs first to rebuild
it from its files, then the salvage copies what that leaves.

The damaged database is kept beside the new one (`db.damaged-<time>`) for the
operator; nothing is deleted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from rocksdict import Rdict, RdictIter

from fila.storage import keys
from fila.storage.backend import rocks_options

# Wider than any key the broker writes (queue names 259, config keys 1024 bytes).
_KEY_WIDTH = 1100
_KEY_SPACE = 1 << (8 * _KEY_WIDTH)


@dataclass(slots=True)
class SalvageReport:
    copied: int = 0
    damaged_regions: list[tuple[str, str]] = field(default_factory=list)
    rebuilt_by_rocksdb: bool = False
    kept_at: Path | None = None
    by_kind: dict[str, int] = field(default_factory=dict)


def salvage(data_dir: Path) -> SalvageReport:
    report = SalvageReport()
    db_dir = data_dir / "db"
    try:
        source = Rdict(str(db_dir), options=rocks_options())
    except Exception:  # rocksdict raises plain Exception; the WAL or MANIFEST is damaged
        Rdict.repair(str(db_dir), rocks_options())
        report.rebuilt_by_rocksdb = True
        source = Rdict(str(db_dir), options=rocks_options())
    target_dir = data_dir / "db.salvaged"
    target = Rdict(str(target_dir), options=rocks_options())
    try:
        _copy_readable(source, target, report)
        target.flush_wal(True)
    finally:
        target.close()
        source.close()
    kept = data_dir / f"db.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
    db_dir.rename(kept)
    target_dir.rename(db_dir)
    report.kept_at = kept
    return report


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
        resume = _next_readable(it, last)
        report.damaged_regions.append((last.hex()[:40], resume.hex()[:40] if resume else "end"))
        if resume is None:
            return


def _valid(it: RdictIter) -> bool:
    return bool(it.valid())


def _ok(it: RdictIter) -> bool:
    try:
        it.status()
    except Exception:  # the iterator stopped on an error
        return False
    return True


def _next_readable(it: RdictIter, after: bytes) -> bytes | None:
    """Positions `it` on the first key it can read past the damage after `after`;
    returns the seek target used, or None when nothing readable follows."""
    base = int.from_bytes(after.ljust(_KEY_WIDTH, b"\x00"), "big")

    def readable(target: int) -> bool:
        it.seek(target.to_bytes(_KEY_WIDTH, "big"))
        return _ok(it)

    step, bad = 1, base
    while True:
        good = base + step
        if good >= _KEY_SPACE:
            return None
        if readable(good):
            break
        bad, step = good, step * 2
    while good - bad > 1:
        middle = (bad + good) // 2
        if readable(middle):
            good = middle
        else:
            bad = middle
    target = good.to_bytes(_KEY_WIDTH, "big")
    it.seek(target)
    return target.rstrip(b"\x00")
