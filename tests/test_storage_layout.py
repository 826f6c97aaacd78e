"""The key layout (`fila.storage.keys`): message keys sort after everything else, so a
burst of enqueues costs RocksDB no rewriting compaction; and a data directory of the
older layout is brought up to date at startup (`fila.storage.layout`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
from rocksdict import Rdict
from support import ServerFactory
from support.stubs import connect

from fila.clock import SystemClock
from fila.core.ids import IdGenerator
from fila.storage import keys
from fila.storage.backend import Batch, MemoryStorage, RocksStorage, rocks_options
from fila.storage.layout import upgrade_layout
from fila_bench.server import rocksdb_log_events

SETTLE_S = 30.0


def _tags() -> dict[str, bytes]:
    return {
        name: value
        for name, value in vars(keys).items()
        if name.isupper() and isinstance(value, bytes) and len(value) == 1
    }


def test_every_record_kind_sorts_before_the_messages() -> None:
    tags = _tags()
    assert len(set(tags.values())) == len(tags), tags
    others = {name: tag for name, tag in tags.items() if name != "MESSAGE"}
    assert {"QUEUE", "NODE", "LEASE", "DELAY", "CONFIG", "API_KEY", "ACL"} <= others.keys()
    assert all(tag < keys.MESSAGE for tag in others.values()), others
    assert not set(keys.LEGACY_TAGS) & set(tags.values()), "a legacy tag was reused"


def _write_like_a_broker_under_a_burst(db_dir: Path) -> dict[str, int]:
    """Every record kind but messages, then a burst of messages with growing ids, into a
    RocksDB with the broker's settings and 1 MiB memtables (so 40 MiB make 40 tables and
    several rounds of level-0 compaction); the LOG's compaction events after it settles."""
    options = rocks_options()
    options.set_write_buffer_size(1024 * 1024)
    db = Rdict(str(db_dir), options=options)
    try:
        db[keys.queue_key("orders")] = b"{}"
        db[keys.node_key("node_id")] = b"1"
        db[keys.config_key("app.weight")] = b"2"
        db[keys.api_key_key("k1")] = b"{}"
        db[keys.acl_key("k1")] = b"[]"
        ids = IdGenerator(SystemClock())
        first = keys.message_key(ids.next()[1])
        db[keys.lease_key(first)] = keys.encode_lease(1, 0)
        db[keys.delay_key(first)] = keys.encode_due(1)
        payload = bytes(64 * 1024)
        for _ in range(640):
            db[keys.message_key(ids.next()[1])] = payload
        db.flush()
        deadline = time.monotonic() + SETTLE_S
        while db.property_int_value("rocksdb.compaction-pending") or db.property_int_value(
            "rocksdb.num-running-compactions"
        ):
            assert time.monotonic() < deadline, "RocksDB did not settle"
            time.sleep(0.05)
    finally:
        db.close()
    events = rocksdb_log_events(db_dir / "LOG")
    assert events is not None, "RocksDB wrote no LOG"
    return events


def test_a_burst_of_enqueues_is_moved_down_the_levels_not_rewritten(tmp_path: Path) -> None:
    """Why messages sort last: each table of the burst overlaps nothing stored, so
    RocksDB moves it instead of merging it (see `fila.storage.keys`)."""
    events = _write_like_a_broker_under_a_burst(tmp_path / "db")
    assert events["trivial_move"] > 0, events
    assert events["compaction_started"] == 0, events


def _legacy(storage: MemoryStorage, **records: bytes) -> None:
    batch = Batch()
    for key, value in records.items():
        batch.put(key.encode(), value)
    storage.write(batch)


def test_the_upgrade_moves_old_records_to_their_new_tags_and_leaves_the_rest() -> None:
    storage = MemoryStorage()
    message = keys.message_key("0190a2b3-c4d5-7e6f-8a9b-0c1d2e3f4a5b")
    _legacy(storage, qorders=b"orders record", qplain=b"plain record", nnode_id=b"3")
    batch = Batch()
    batch.put(message, b"a message")
    batch.put(keys.config_key("app.x"), b"1")
    storage.write(batch)
    syncs = storage.sync_count

    assert upgrade_layout(storage) == 3
    assert storage.sync_count == syncs + 1, "the upgrade is durable before anything reads it"
    assert storage.get(keys.queue_key("orders")) == b"orders record"
    assert storage.get(keys.queue_key("plain")) == b"plain record"
    assert storage.get(keys.node_key("node_id")) == b"3"
    assert list(storage.scan(b"q")) == [] and list(storage.scan(b"n")) == []
    assert storage.get(message) == b"a message"
    assert storage.get(keys.config_key("app.x")) == b"1"
    assert upgrade_layout(storage) == 0, "a second start has nothing to move"
    assert storage.sync_count == syncs + 1


def test_a_record_under_both_tags_takes_the_one_an_older_broker_wrote_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only an older fila-server writes the old tags, and only after an upgrade removed
    them all: its record is the newer one."""
    storage = MemoryStorage()
    batch = Batch()
    batch.put(keys.queue_key("orders"), b"upgraded orders")
    batch.put(keys.queue_key("plain"), b"plain")
    storage.write(batch)
    _legacy(storage, qorders=b"orders written later")

    with caplog.at_level(logging.WARNING, logger="fila.storage"):
        assert upgrade_layout(storage) == 1
    assert storage.get(keys.queue_key("orders")) == b"orders written later"
    assert storage.get(b"qorders") is None
    assert storage.get(keys.queue_key("plain")) == b"plain"
    assert [r.key for r in caplog.records] == ["Qorders"]  # type: ignore[attr-defined]


def _downgrade_to_the_old_layout(data_dir: Path) -> int:
    """Rewrites a stopped broker's queue records under the old tag, as an older
    fila-server stored them."""
    storage = RocksStorage(data_dir)
    try:
        batch = Batch()
        for key, value in storage.scan(keys.QUEUE):
            batch.put(b"q" + key[1:], value)
            batch.delete(key)
        storage.write(batch)
        storage.sync()
    finally:
        storage.close()
    return len(batch.ops) // 2


def test_a_data_directory_of_the_old_layout_keeps_its_queues_and_messages(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("orders")
        sent = [fila.enqueue("orders", f"order {i}".encode()) for i in range(3)]
    assert server.stop() == 0, server.log_text()[-2000:]
    assert _downgrade_to_the_old_layout(server.data_dir) == 2  # orders and orders.dlq

    server.start()
    with connect(server.addr) as fila:
        assert fila.queue_names() == ["orders", "orders.dlq"]
        with fila.consume("orders") as stream:
            received = [stream.get(10.0) for _ in sent]
        assert [m.id for m in received] == sent
        assert [m.payload for m in received] == [b"order 0", b"order 1", b"order 2"]
    assert "key layout upgraded" in server.log_text()
    assert server.stop() == 0, server.log_text()[-2000:]
    storage = RocksStorage(server.data_dir)
    try:
        assert list(storage.scan(b"q")) == []
        assert len(list(storage.scan(keys.QUEUE))) == 2
    finally:
        storage.close()
