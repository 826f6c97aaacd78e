"""`fila-server --repair`: salvage a damaged data directory offline, then set aside the
records that do not decode, and say what was kept, skipped and set aside.

The salvage itself is `fila.storage.salvage`; the record pass is
`fila.core.quarantine.sweep`. Every line printed starts with `fila-server:` and names
what happened and its consequence for acknowledged messages.
"""

from __future__ import annotations

from pathlib import Path

from fila.core.quarantine import describe, sweep
from fila.server.startup import ExitCode, StartupError, fail, open_storage
from fila.storage.backend import DataDirInUse
from fila.storage.salvage import salvage


def repair(data_dir: Path, *, drop_quarantined: bool) -> int:
    """Salvages a damaged data directory (see `fila.storage.salvage`), sets aside the
    records that do not decode (`fila.core.quarantine.sweep`), and reports both."""
    if not (data_dir / "db").exists():
        return fail(f"{data_dir} holds no database to repair", ExitCode.STARTUP_FAILED)
    try:
        report = salvage(data_dir)
    except DataDirInUse as exc:
        return fail(str(exc), ExitCode.STARTUP_FAILED)
    except Exception as exc:  # rocksdict raises plain Exception; report it as it is
        return fail(f"repair of {data_dir} failed: {exc}", ExitCode.DATA_DAMAGED)
    kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(report.by_kind.items()))
    skipped_bytes = sum(piece.bytes for piece in report.skipped_wal)
    print(
        f"fila-server: repaired {data_dir}: kept {report.copied} records ({kinds or 'none'}); "
        f"{len(report.damaged_regions)} damaged region(s) skipped"
        + (f", {skipped_bytes} unreadable WAL bytes skipped" if report.skipped_wal else "")
        + (f", {report.replayed_batches} WAL batches replayed" if report.replayed_batches else "")
        + (", database rebuilt by RocksDB first" if report.rebuilt_by_rocksdb else "")
        + (f", {len(report.lost_files)} unreadable file(s) left out" if report.lost_files else "")
        + f"; the damaged original is kept at {report.kept_at}. Start the broker normally; "
        "messages of a queue whose record was lost come back when that queue is "
        "created again and the broker restarted."
    )
    for name, size in report.lost_files:
        print(
            f"fila-server: RocksDB's repair could not read {name} ({size} bytes) and left it "
            f"out (its original is in {report.kept_at}): its records are lost, and a message "
            "whose ack was among them is delivered again"
        )
    for start, end in report.damaged_regions:
        print(f"fila-server: skipped unreadable keys after {start or '(start)'} up to {end}")
    for piece in report.skipped_wal:
        consequence = (
            "the writes in them are lost, and a message whose ack was among them is delivered again"
            if piece.lost
            else "every write in them was already in the tables: nothing is lost"
        )
        print(
            f"fila-server: skipped {piece.bytes} unreadable bytes of the write-ahead log "
            f"{piece.file} at offset {piece.offset} ({piece.reason}): {consequence}"
        )
    return _sweep(data_dir, drop_quarantined=drop_quarantined)


def _sweep(data_dir: Path, *, drop_quarantined: bool) -> int:
    try:
        storage = open_storage(data_dir, direct_io=False)
    except StartupError as exc:
        return fail(str(exc), exc.code)
    try:
        swept = sweep(storage, drop=drop_quarantined)
    finally:
        storage.close()
    for key, reason in swept.set_aside:
        print(f"fila-server: set aside {describe(key)}: {reason}")
    if swept.dropped:
        print(f"fila-server: deleted the {swept.dropped} record(s) set aside (--drop-quarantined)")
    elif swept.held:
        print(
            f"fila-server: {swept.held} record(s) that do not decode are set aside, not served; "
            "--repair --drop-quarantined deletes them"
        )
    return ExitCode.OK
