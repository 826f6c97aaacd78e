"""The engine settings RocksStorage opens with, read back from RocksDB's own OPTIONS
file: what the broker asks for is what RocksDB runs with."""

from __future__ import annotations

from pathlib import Path

from fila.storage.backend import Batch, RocksStorage, supports_direct_io
from tests.support import ServerFactory


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
    """O_DIRECT flushes and compactions keep the WAL's fdatasync from queueing behind
    table pages the kernel writes back (see `rocks_options`)."""
    storage = RocksStorage(tmp_path)
    try:
        batch = Batch()
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
    assert settings["writable_file_max_buffer_size"] == str(256 * 1024)  # see rocks_options
    assert not (tmp_path / ".direct-io-probe").exists()


def test_the_direct_io_probe_says_no_where_it_cannot_write(tmp_path: Path) -> None:
    assert supports_direct_io(tmp_path / "missing") is False
    assert not (tmp_path / "missing").exists()


def test_direct_io_can_be_turned_off(tmp_path: Path) -> None:
    storage = RocksStorage(tmp_path, direct_io=False)
    try:
        settings = _rocksdb_options(storage.path)
    finally:
        storage.close()
    assert storage.direct_io is False
    assert settings["use_direct_io_for_flush_and_compaction"] == "false"


def test_the_broker_opens_its_storage_as_configured(server_factory: ServerFactory) -> None:
    """`storage.direct_io` reaches RocksDB in a real fila-server (on by default)."""
    default = server_factory()
    db_dir = default.data_dir / "db"
    expected = "true" if supports_direct_io(default.data_dir) else "false"
    assert _rocksdb_options(db_dir)["use_direct_io_for_flush_and_compaction"] == expected
    default.stop()
    off = server_factory(config_toml="[storage]\ndirect_io = false\n")
    off_settings = _rocksdb_options(off.data_dir / "db")
    assert off_settings["use_direct_io_for_flush_and_compaction"] == "false"
