"""Damaged data is never served silently and never makes the broker delete data.

Each test damages a real RocksDB data directory the way disks and crashes do (bytes
flipped in an .sst file, among queue records, in the WAL after kill -9) and checks
that the broker refuses to start with one clear line naming the damage and the way
out (exit code 4), that nothing was deleted, and that `fila-server --repair` then
brings back what is readable.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

import pytest
from rocksdict import Rdict
from support import ServerFactory
from support.stubs import connect

from fila.storage import keys, salvage
from fila.storage.backend import Batch, CorruptionError, RocksStorage, rocks_options
from fila.testing.server import ServerProcess

DATA_DAMAGED = 4
PROMPT_S = 10.0


def _fila_server(
    server: ServerProcess | Path, *args: str, timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """Runs fila-server with the harness's environment until it exits by itself, on
    `server`'s data directory and address, or on a data directory alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FILA_")}
    if isinstance(server, Path):
        env.update(FILA_DATA_DIR=str(server))
    else:
        env.update(FILA_DATA_DIR=str(server.data_dir), FILA_LISTEN_ADDR=server.addr)
    return subprocess.run(
        [sys.executable, "-m", "fila.server.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _run_server(server: ServerProcess, *args: str, timeout: float = 30.0) -> tuple[int, str]:
    proc = _fila_server(server, *args, timeout=timeout)
    return proc.returncode, proc.stderr


def _run_repair(server: ServerProcess | Path) -> tuple[int, str]:
    proc = _fila_server(server, "--repair", timeout=60.0)
    return proc.returncode, proc.stdout + proc.stderr


def _fill(server: ServerProcess, queues: dict[str, int]) -> None:
    with connect(server.addr) as fila:
        for name in queues:
            fila.create_queue(name)
    _fill_existing(server, queues)


def _fill_existing(server: ServerProcess, queues: dict[str, int]) -> None:
    with connect(server.addr) as fila:
        for name, count in queues.items():
            for i in range(count):
                fila.enqueue(name, b"%s-%d" % (name.encode(), i) + os.urandom(200))


def _flip(path: str, offset: int, count: int = 8) -> bytes:
    data = bytearray(Path(path).read_bytes())
    original = bytes(data[offset : offset + count])
    for i in range(count):
        data[offset + i] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    return original


def _restore(path: str, offset: int, original: bytes) -> None:
    data = bytearray(Path(path).read_bytes())
    data[offset : offset + len(original)] = original
    Path(path).write_bytes(bytes(data))


def _sst(server: ServerProcess) -> str:
    (sst,) = glob.glob(str(server.data_dir / "db" / "*.sst"))
    return sst


def _one_line_refusal(code: int, stderr: str) -> str:
    assert code == DATA_DAMAGED, f"exit code {code}, stderr:\n{stderr}"
    lines = [line for line in stderr.splitlines() if line.startswith("fila-server:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert "--repair" in lines[0]
    return lines[0]


def _counts(data_dir: Path) -> tuple[int, int]:
    """(queue records, message records), counting those set aside as undecodable too:
    the repair keeps them, under the quarantine's keys."""
    storage = RocksStorage(data_dir)
    try:
        aside = [key[1:2] for key, _ in storage.scan(keys.QUARANTINE)]
        return (
            sum(1 for _ in storage.scan(keys.QUEUE)) + aside.count(keys.QUEUE),
            sum(1 for _ in storage.scan(keys.MESSAGE)) + aside.count(keys.MESSAGE),
        )
    finally:
        storage.close()


def test_a_flipped_block_in_an_sst_file_refuses_to_start(server_factory: ServerFactory) -> None:
    server = server_factory(persist_mode="sync")
    _fill(server, {"orders": 1000})
    server.stop()  # a graceful close flushes the memtable into one .sst file
    sst = _sst(server)
    _flip(sst, os.path.getsize(sst) // 3)

    line = _one_line_refusal(*_run_server(server))
    assert os.path.basename(sst) in line

    code, _ = _run_server(server, "--repair")
    assert code == 0
    server.start()
    with connect(server.addr) as fila:
        depth = fila.stats("orders").depth
    assert 900 <= depth < 1000, f"repair kept {depth} of 1000 messages"


def _fixed_records(seed: int) -> dict[bytes, bytes]:
    """The fixed table's records: one queue and 1,000 messages (random keys and
    200-byte values drawn from `seed`), the same every time."""
    rng = random.Random(seed)
    records = {keys.queue_key("orders"): b"orders"}
    for _ in range(1000):
        records[keys.MESSAGE + rng.randbytes(16)] = rng.randbytes(200)
    return records


def _fixed_table(data_dir: Path, seed: int) -> str:
    """A database of `_fixed_records(seed)` flushed into one .sst file, built the same
    way every time; returns the file's path."""
    db = Rdict(str(data_dir / "db"), options=rocks_options())
    for key, value in _fixed_records(seed).items():
        db[key] = value
    db.flush(True)
    db.close()
    (sst,) = glob.glob(str(data_dir / "db" / "*.sst"))
    return sst


def test_repair_resumes_after_a_damaged_block_and_ends(tmp_path: Path) -> None:
    """With this table's middle block damaged, `--repair` once looped forever: its
    search for the next readable key reused one RocksDB iterator, which remembers the
    block it read, so the target it settled on failed again when the copy resumed.
    (The table's records are not valid broker records: the repair copies them, then
    sets them aside as undecodable.)"""
    sst = _fixed_table(tmp_path, seed=13)
    _flip(sst, os.path.getsize(sst) // 3)

    code, output = _run_repair(tmp_path)

    assert code == 0, output
    queues, messages = _counts(tmp_path)
    assert queues == 1
    assert 950 <= messages < 1000, f"repair kept {messages} of 1000 messages"
    assert "1 damaged region(s) skipped" in output, output


def _readable_by_lookup(data_dir: Path, wanted: list[bytes]) -> set[bytes]:
    """The keys of `wanted` that a point lookup (checksums verified) still reads in
    `data_dir`'s database, looked up in a copy so the original stays as it is."""
    copy = data_dir.parent / f"{data_dir.name}-lookup"
    shutil.copytree(data_dir / "db", copy / "db")
    storage = RocksStorage(copy)
    readable = set()
    try:
        for key in wanted:
            try:
                if storage.get(key) is not None:
                    readable.add(key)
            except CorruptionError:  # its block fails its checksum
                pass
    finally:
        storage.close()
    return readable


def _stored_keys(data_dir: Path) -> set[bytes]:
    """Every queue and message key a repaired data directory holds, set aside or not."""
    storage = RocksStorage(data_dir)
    try:
        kept = {key for prefix in (keys.QUEUE, keys.MESSAGE) for key, _ in storage.scan(prefix)}
        aside = {keys.original_from_quarantine_key(k) for k, _ in storage.scan(keys.QUARANTINE)}
        return kept | aside
    finally:
        storage.close()


def test_repair_keeps_every_readable_block_between_damaged_ones(tmp_path: Path) -> None:
    """One byte flipped in each of 10 blocks spread over one table: the search for the
    next readable key after a damaged block doubled its step past the readable blocks
    lying between damaged ones, into the next damaged block, and dropped them (it
    kept 422 of the 1,001 keys, where point lookups read 830). Every key a lookup
    reads must be kept, and each run of unreadable keys reported as one region."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    sst = _fixed_table(data_dir, seed=13)
    size = os.path.getsize(sst)
    for i in range(10):  # every damaged block has readable blocks on both sides
        _flip(sst, 2000 + i * ((size - 6000) // 10), count=1)
    ordered = sorted(_fixed_records(13))
    readable = _readable_by_lookup(data_dir, ordered)
    unreadable_runs = sum(
        1
        for i, key in enumerate(ordered)
        if key not in readable and (i == 0 or ordered[i - 1] in readable)
    )
    assert unreadable_runs == 10 and len(readable) < len(ordered)

    code, output = _run_repair(data_dir)

    assert code == 0, output
    kept = _stored_keys(data_dir)
    dropped = readable - kept
    assert not dropped, f"repair dropped {len(dropped)} readable keys; kept {len(kept)}"
    assert kept <= set(ordered)
    assert f"{unreadable_runs} damaged region(s) skipped" in output, output


def _chained_records() -> dict[bytes, bytes]:
    """10 chains of 120 message keys, each key the previous one plus a zero byte
    (`m\\x00\\x07`, `m\\x00\\x07\\x00`, ...), with 200-byte values: a chain spans
    several blocks, so nearly every block boundary falls between a key and its
    successor, and most blocks lie inside a chain."""
    rng = random.Random(7)
    records = {keys.queue_key("orders"): b"orders"}
    for chain in range(10):
        for zeros in range(120):
            records[keys.MESSAGE + chain.to_bytes(2, "big") + b"\x00" * zeros] = rng.randbytes(200)
    return records


def _unreadable_runs(ordered: list[bytes], readable: set[bytes]) -> list[tuple[int, int]]:
    """The runs of consecutive unreadable keys of `ordered`, as [first, end) indexes."""
    runs: list[tuple[int, int]] = []
    for i, key in enumerate(ordered):
        if key in readable:
            continue
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def test_repair_keeps_a_readable_key_that_is_the_previous_key_plus_a_zero_byte(
    tmp_path: Path,
) -> None:
    """The search for the next readable key stood for keys by zero-padded integers, so
    `k` and `k + b"\\x00"` were one place and a seek there passed over every key
    between: a damaged block ending in `k` lost the readable `k + b"\\x00"` after it,
    and a damaged block inside a chain (its search starting past the last key read
    before it) lost the chain's readable rest. Every key a point lookup reads must be
    kept, and each run of unreadable keys reported once."""
    data_dir = tmp_path / "data"
    db = Rdict(str(data_dir / "db"), options=rocks_options())
    records = _chained_records()
    for key, value in records.items():
        db[key] = value
    db.flush(True)
    db.close()
    (sst,) = glob.glob(str(data_dir / "db" / "*.sst"))
    size = os.path.getsize(sst)
    for i in range(6):  # damaged blocks with readable ones on both sides
        _flip(sst, 2000 + i * ((size - 6000) // 6), count=1)
    ordered = sorted(records)
    readable = _readable_by_lookup(data_dir, ordered)
    runs = _unreadable_runs(ordered, readable)
    inner = [(first, end) for first, end in runs if first > 0 and end < len(ordered)]
    # Both ways the old search lost keys are here: a readable successor of the last
    # unreadable key, and readable keys of one chain on both sides of the damage.
    assert any(ordered[end] == ordered[end - 1] + b"\x00" for _, end in inner)
    assert any(ordered[end].startswith(ordered[first - 1]) for first, end in inner)

    report = salvage.salvage(data_dir)

    kept = _stored_keys(data_dir)
    dropped = readable - kept
    assert not dropped, f"repair dropped {len(dropped)} readable keys, e.g. {min(dropped)!r}"
    assert kept <= set(ordered)
    assert len(report.damaged_regions) == len(runs), report.damaged_regions


class _NoErrorRepeats:
    """A database stand-in for the salvage's search: seeks below `readable_from` fail,
    each with an error never seen before (nothing tells two damaged blocks apart)."""

    def __init__(self, readable_from: bytes) -> None:
        self.readable_from = readable_from
        self.seeks = 0
        self._reads = False

    def iter(self) -> _NoErrorRepeats:
        return self

    def seek(self, target: bytes) -> None:
        self.seeks += 1
        self._reads = target >= self.readable_from

    def status(self) -> None:
        if not self._reads:
            raise Exception(f"Corruption: failed seek number {self.seeks}")


def test_the_repair_search_ends_when_errors_never_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search tells damaged blocks apart by their errors; errors that never repeat
    would have it split the key space without end. Past its probe budget it treats
    every two failures as one damaged span and ends, as the old search did."""
    monkeypatch.setattr(salvage, "_PROBE_BUDGET", 1000)
    readable_from = b"m" + b"\x00" * 900 + b"\x01"
    source = _NoErrorRepeats(readable_from)

    found = salvage._next_readable(cast(Rdict, source), b"")

    assert found == readable_from
    assert source.seeks < 1000 + 3 * salvage._POSITION_BITS, source.seeks


def test_damaged_queue_records_never_lead_to_deleted_messages(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    _fill(server, {"alpha": 0, "beta": 0, "gamma": 0})
    server.stop()  # this .sst file holds the queue records and nothing else
    (queues_sst,) = glob.glob(str(server.data_dir / "db" / "*.sst"))
    server.start()
    _fill_existing(server, {"alpha": 100, "beta": 100, "gamma": 100})
    server.stop()
    before = _counts(server.data_dir)
    offset = 16  # inside the first (and only) data block
    original = _flip(queues_sst, offset)

    _one_line_refusal(*_run_server(server))
    _one_line_refusal(*_run_server(server))  # twice: the first refusal changed nothing

    _restore(queues_sst, offset, original)
    assert _counts(server.data_dir) == before
    server.start()
    with connect(server.addr) as fila:
        depths = {name: fila.stats(name).depth for name in ("alpha", "beta", "gamma")}
    assert depths == {"alpha": 100, "beta": 100, "gamma": 100}


def test_a_queue_record_that_does_not_decode_is_set_aside_and_the_rest_served(
    server_factory: ServerFactory,
) -> None:
    """One bad queue record must not keep every good queue offline: it is set aside (its
    messages reported as orphans, kept), the broker starts, and `--repair` lists it."""
    server = server_factory(persist_mode="sync")
    _fill(server, {"alpha": 10, "beta": 10})
    server.stop()
    storage = RocksStorage(server.data_dir)
    batch = Batch()
    batch.put(keys.queue_key("beta"), b"{not json")
    storage.write(batch)
    storage.sync()
    storage.close()

    server.start()
    with connect(server.addr) as fila:
        assert fila.stats("alpha").depth == 10
        assert "beta" not in {q.name for q in fila.list_queues().queues}
    log = server.log_path.read_text()
    assert "does not decode; it was set aside" in log and "Qbeta" in log
    server.stop()
    assert _counts(server.data_dir) == (4, 20)  # alpha, beta and their DLQs; nothing deleted

    code, output = _run_repair(server)
    assert code == 0, output
    assert "1 record(s) that do not decode are set aside" in output, output
    code, output = _fila_server(server, "--repair", "--drop-quarantined").returncode, ""
    assert code == 0
    assert _counts(server.data_dir) == (3, 20)


def test_a_bit_flip_in_the_wal_after_kill_9_refuses_instead_of_dropping_acknowledged_data(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    _fill(server, {"orders": 1000})
    server.kill()
    (wal,) = sorted(glob.glob(str(server.data_dir / "db" / "*.log")), key=os.path.getsize)[-1:]
    saved = server.data_dir.parent / "wal-copy"
    shutil.copy(wal, saved)
    _flip(wal, os.path.getsize(wal) // 2, count=1)

    line = _one_line_refusal(*_run_server(server))
    assert "damaged" in line

    shutil.copy(saved, wal)  # the operator restores the file: everything is there
    server.start()
    with connect(server.addr) as fila:
        assert fila.stats("orders").depth == 1000


def _message_key(message_id: str) -> bytes:
    return keys.MESSAGE + bytes.fromhex(message_id.replace("-", ""))


def test_repair_after_wal_damage_keeps_every_readable_write_and_reports_the_rest(
    server_factory: ServerFactory,
) -> None:
    """A damaged WAL record (here an ack's) costs only its own writes: every answered
    enqueue after it is kept, the report names the skipped bytes and what they cost,
    and the damaged original is kept as it was."""
    server = server_factory(persist_mode="sync")
    with connect(server.addr) as fila:
        fila.create_queue("q")
        first = [fila.enqueue("q", b"first-%d" % i) for i in range(5)]
        with fila.consume("q", prefetch=1) as stream:
            acked = stream.get(PROMPT_S).id
        fila.ack("q", acked)
        later = [fila.enqueue("q", b"later-%d" % i) for i in range(50)]
    server.kill()
    (wal,) = glob.glob(str(server.data_dir / "db" / "*.log"))
    data = Path(wal).read_bytes()
    delete = bytes([0x00, 1 + 16]) + _message_key(acked)  # the ack's delete, tag and length
    _flip(wal, data.index(delete) + 6, count=1)
    damaged = Path(wal).read_bytes()
    _one_line_refusal(*_run_server(server))

    code, output = _run_repair(server)
    assert code == 0, output
    (line,) = [row for row in output.splitlines() if "write-ahead log" in row]
    assert f"{os.path.basename(wal)} at offset" in line and "delivered again" in line
    (kept,) = server.data_dir.glob("db.damaged-*")
    assert (kept / os.path.basename(wal)).read_bytes() == damaged

    storage = RocksStorage(server.data_dir)
    try:
        present = [storage.get(_message_key(i)) is not None for i in first + later]
    finally:
        storage.close()
    assert all(present), f"{present.count(False)} answered enqueues lost"
    server.start()
    with connect(server.addr) as fila:
        stats = fila.stats("q")
    assert stats.depth + stats.in_flight == 55  # the acked one is back: its ack was unreadable


def test_repair_refuses_a_data_directory_a_running_broker_holds(
    server_factory: ServerFactory,
) -> None:
    server = server_factory()
    code, output = _run_repair(server)
    assert code == 1, output
    assert "in use by another fila-server" in output
    assert not list(server.data_dir.glob("db.*"))  # nothing kept aside, nothing changed
    with connect(server.addr) as fila:
        fila.create_queue("still-serving")


def _repair_keeps_all(server: ServerProcess, messages: int) -> None:
    """`--repair` exits 0 and keeps the queue (and its DLQ) and all `messages`."""
    code, output = _run_repair(server)
    assert code == 0, output
    assert _counts(server.data_dir) == (2, messages)


def _files(db: Path) -> dict[str, bytes]:
    """The database's files and contents, RocksDB's info logs aside."""
    return {
        p.name: p.read_bytes() for p in db.iterdir() if p.is_file() and not p.name.startswith("LOG")
    }


def test_a_missing_current_refuses_changes_nothing_and_repairs_whole(
    server_factory: ServerFactory,
) -> None:
    """Without CURRENT (which names the live MANIFEST) RocksDB took the directory for a
    new database: the refusal wrote an empty one over it, the next start served
    nothing and deleted every table, and `--repair` kept nothing."""
    server = server_factory(persist_mode="sync")
    _fill(server, {"orders": 200})
    server.stop()
    db = server.data_dir / "db"
    (db / "CURRENT").unlink()
    before = _files(db)

    line = _one_line_refusal(*_run_server(server))
    assert "CURRENT" in line
    _one_line_refusal(*_run_server(server))  # twice: the first refusal changed nothing
    assert _files(db) == before

    _repair_keeps_all(server, 200)


def test_current_naming_a_missing_manifest_refuses_as_damage(
    server_factory: ServerFactory,
) -> None:
    """A CURRENT that names a MANIFEST that is not there (one flipped digit) exited 1,
    "could not start", without pointing at `--repair`: a supervisor restarted it forever."""
    server = server_factory(persist_mode="sync")
    _fill(server, {"orders": 50})
    server.stop()
    current = server.data_dir / "db" / "CURRENT"
    current.write_text(current.read_text().replace("MANIFEST-", "MANIFEST-9"))

    line = _one_line_refusal(*_run_server(server))
    assert "MANIFEST" in line

    _repair_keeps_all(server, 50)


def test_a_table_that_does_not_open_is_refused_on_one_line_and_its_loss_reported(
    server_factory: ServerFactory,
) -> None:
    """A truncated table: RocksDB's message spans two lines, so the refusal's line did
    not name `--repair`; and RocksDB's repair, the fallback, drops such a table whole
    without a word, which the report now says, naming the file."""
    server = server_factory(persist_mode="sync")
    _fill(server, {"orders": 300})
    server.stop()
    sst = Path(_sst(server))
    sst.write_bytes(sst.read_bytes()[: sst.stat().st_size * 2 // 3])

    _one_line_refusal(*_run_server(server))

    code, output = _run_repair(server)
    assert code == 0, output
    assert f"could not read {sst.name}" in output, output
    assert "1 unreadable file(s) left out" in output, output


def test_a_second_repair_in_the_same_second_keeps_both_originals(
    server_factory: ServerFactory,
) -> None:
    """The kept original's directory is named to the second: a second repair within it
    failed (exit 4, "File exists") where a repair should always be harmless to repeat."""
    server = server_factory(persist_mode="sync")
    _fill(server, {"orders": 10})
    server.stop()
    rdconfig = server.data_dir / "db" / "rocksdict-config.json"
    damaged = rdconfig.read_bytes()[:20]
    rdconfig.write_bytes(damaged)
    now = time.time()
    taken = {time.strftime("%Y%m%dT%H%M%S", time.localtime(now + s)) for s in range(4)}
    for stamp in taken:  # whatever second the repair runs in, its name is taken
        (server.data_dir / f"db.damaged-{stamp}").mkdir()

    _repair_keeps_all(server, 10)
    (kept,) = set(server.data_dir.glob("db.damaged-*.1"))
    # the open rewrites this file in place: a hard link would not have kept it
    assert (kept / "rocksdict-config.json").read_bytes() == damaged
