"""The engine settings RocksStorage opens with, read back from RocksDB's own OPTIONS
file: what the broker asks for is what RocksDB runs with."""

from __future__ import annotations

from pathlib import Path

from fila.storage.backend import RocksStorage, supports_direct_io


def _rocksdb_options(db_dir: Path) -> dict[str, str]:
    newest = max(db_dir.glob("OPTIONS-*"), key=lambda p: int(p.name.split("-")[1]))
    settings: dict[str, str] = {}
    for line in newest.read_text().splitlines():
        name, sep, value = line.strip().partition("=")
        if sep:
            settings.setdefault(name, value)
    return settings


def test_tables_are_written_around_the_page_cache_where_the_filesystem_allows(
    tmp_path: Path,
) -> None:
    """O_DIRECT flushes and compactions keep table data out of the journal commit
    every WAL fdatasync waits for (see `rocks_options`)."""
    storage = RocksStorage(tmp_path)
    try:
        batch = storage.new_batch()
        for i in range(256):
            batch.put(b"k%04d" % i, bytes(4096))
        storage.write(batch)
        storage._db.flush()  # a real table written with the setting in force
        assert storage.get(b"k0255") == bytes(4096)
        settings = _rocksdb_options(storage.path)
    finally:
        storage.close()
    assert storage.direct_io == supports_direct_io(tmp_path)
    expected = "true" if storage.direct_io else "false"
    assert settings["use_direct_io_for_flush_and_compaction"] == expected
    assert not (tmp_path / ".direct-io-probe").exists()


def test_the_direct_io_probe_says_no_where_it_cannot_write(tmp_path: Path) -> None:
    assert supports_direct_io(tmp_path / "missing") is False
    assert not (tmp_path / "missing").exists()
