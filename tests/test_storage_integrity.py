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
import shutil
import subprocess
import sys
from pathlib import Path

from support import ServerFactory
from support.stubs import connect

from fila.server.process import ServerProcess
from fila.storage import keys
from fila.storage.backend import Batch, RocksStorage

DATA_DAMAGED = 4
PROMPT_S = 10.0


def _run_server(server: ServerProcess, *args: str, timeout: float = 30.0) -> tuple[int, str]:
    """Runs fila-server with the harness's environment until it exits by itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FILA_")}
    env.update(FILA_DATA_DIR=str(server.data_dir), FILA_LISTEN_ADDR=server.addr)
    proc = subprocess.run(
        [sys.executable, "-m", "fila.server.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return proc.returncode, proc.stderr


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
    storage = RocksStorage(data_dir)
    try:
        return (
            sum(1 for _ in storage.scan(keys.QUEUE)),
            sum(1 for _ in storage.scan(keys.MESSAGE)),
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


def test_a_queue_record_that_does_not_decode_refuses_to_start(
    server_factory: ServerFactory,
) -> None:
    server = server_factory(persist_mode="sync")
    _fill(server, {"alpha": 10, "beta": 10})
    server.stop()
    storage = RocksStorage(server.data_dir)
    batch = Batch()
    batch.put(keys.queue_key("beta"), b"{not json")
    storage.write(batch)
    storage.sync()
    storage.close()

    line = _one_line_refusal(*_run_server(server))
    assert "queue record" in line
    assert _counts(server.data_dir) == (4, 20)  # alpha, beta and their DLQs; nothing deleted


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
