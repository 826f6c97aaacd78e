"""Stamps where each enqueue is inside a broker, for `scripts/roundtrip.py` only.

On PYTHONPATH with ROUNDTRIP_STAMPS=FILE, a broker process (`fila.server.main` or
`fila-server`) records, for every call into `Enqueueing.enqueue`, the monotonic
nanoseconds at which: the handler called the broker (`enqueue`); the committer
appended the batch to the WAL (`write`); the fsync started and ended on its thread
(`sync_start`, `sync_end`); the event loop took the result back (`sync_done`). It
writes them as JSON to FILE at exit. With ROUNDTRIP_THREAD_ONLY=1 (with or without
ROUNDTRIP_STAMPS) every sync goes to the fsync thread (no inline syncs), for
comparison. Nothing here ships in the
package.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

_OUT = os.environ.get("ROUNDTRIP_STAMPS", "")
_IS_BROKER = "fila.server.main" in sys.orig_argv or any(
    a.endswith("fila-server") for a in sys.orig_argv
)


def _install() -> None:
    from fila.core.enqueue import Enqueueing
    from fila.storage.committer import Committer

    stamps: list[dict[str, int]] = []
    now = time.perf_counter_ns
    pending: list[dict[str, int]] = []  # enqueued, not yet appended
    syncing: list[dict[str, int]] = []  # appended, in the sync being run

    enqueue = Enqueueing.enqueue

    def stamped_enqueue(self: Any, requests: Any) -> Any:
        record = {"enqueue": now()}
        stamps.append(record)
        pending.append(record)
        return enqueue(self, requests)

    write_batch = Committer._write_batch

    def stamped_write(self: Any, start_sync: bool = True) -> None:
        t = now()
        for record in pending:
            record["write"] = t
        syncing.extend(pending)
        pending.clear()
        write_batch(self, start_sync)

    fsync = Committer._fsync
    covered: list[dict[str, int]] = []

    def stamped_fsync(self: Any) -> Any:
        mine = list(syncing)
        syncing.clear()
        start = now()
        try:
            return fsync(self)
        finally:
            end = now()
            for record in mine:
                record["sync_start"], record["sync_end"] = start, end
            covered.extend(mine)

    sync_done = Committer._sync_done

    def stamped_done(self: Any, *args: Any) -> None:
        t = now()
        for record in covered:
            record["sync_done"] = t
        covered.clear()
        sync_done(self, *args)

    Enqueueing.enqueue = stamped_enqueue  # type: ignore[method-assign]
    Committer._write_batch = stamped_write  # type: ignore[method-assign]
    Committer._fsync = stamped_fsync  # type: ignore[method-assign]
    Committer._sync_done = stamped_done  # type: ignore[method-assign]

    def dump() -> None:
        with open(_OUT, "w", encoding="utf-8") as out:
            json.dump(stamps, out)

    atexit.register(dump)


if _OUT and _IS_BROKER:
    _install()
