"""The group committer every state change goes through.

Why one committer: a synced RocksDB write through rocksdict holds the GIL for its
whole duration, fsync included, so syncing inside the event loop would stall every
other request for each fsync; and syncing in the loop formed batches of barely more
than one write, because gRPC hands the loop about one request per turn (figures:
docs/benchmarks.md, "Measurements behind design choices").

So writes are split in two. Everything the broker changes during one turn of
the event loop goes into one `WriteBatch`, appended to the WAL without fsync
(a few microseconds) from a `call_soon` callback. In ``sync`` mode a single
thread then fsyncs the WAL with `flush_wal(True)`, which releases the GIL, so
the loop keeps serving while the disk works; every batch written while a sync
is in flight waits for the next one (group commit). Writers never wait on each
other: they add their operations and await `Committer.flushed()`, a future
shared by everything in their batch. Work that must only happen once a write
is durable (a message becoming deliverable) registers with `after_commit`.
A write nobody waits on (a settlement on a stream, which has no reply) asks for
`sync_soon` instead: it becomes durable with the next sync, whatever asks for that
one, and a sync starts `SYNC_SOON_S` after it if nothing else asked for one first.
So a drain's acks share syncs instead of each starting its own, and an ack never
holds up the sync an answer waits for (one sync runs at a time).
``buffer`` mode skips the fsync; the WAL write still happens before the answer,
so a killed process loses nothing, only a power loss can.

A failed write or sync is fatal: the broker's memory already reflects the
change, so it stops rather than serve state the disk does not have.

Every answer waits on the fsync thread, so it runs above the rest of the broker
(15 nice levels by default, `storage.fsync_priority_boost`) where the system allows
it: see fila.storage.thread_priority. (Syncing a lone small batch on the loop
itself when it is idle, sparing the two wake-ups of the hand-off, was measured and
made one-in-flight round trips slower on a busy host: docs/benchmarks.md.)

The path of a write, in order:

1. `put`/`delete` add to the open `Batch` (one per loop turn) and `flushed()` hands
   out the future shared by everything in it; a write names the queue it belongs to,
   if any (a message, its lease or delay, a queue record);
2. `_write_batch` (end of the turn) hands the batch and those names to the batch hook,
   if one is set, which may add to it and return a `Gate`; then appends the batch to
   the WAL, unsynced, and queues its waiters (`_Waiters`) as unsynced (a batch with
   no operations, while nothing is unsynced or syncing, has them answered at once);
3. `_start_sync` hands everything unsynced to the fsync thread (one sync at a time;
   what is written meanwhile waits for the next);
4. `_sync_done` on the loop resolves every waiter the sync covered, oldest first
   (`_Waiters.succeed`: after-commit callbacks, then the future). With a gate, the
   future waits for the gate's answer too, and the after-commit callbacks for its
   `replicated`.

The hook and the gate are cluster replication's (`fila.cluster.replication.gate`):
the leader of a replicated queue hands the queue's part of each batch to its
followers, and its writers are answered once the in-sync ones hold it. Without a
hook (a single node, or no replicated queue) nothing of this runs. `replicate` is the
follower's side: another node's writes, applied in the same group commit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from fila.config import PersistMode
from fila.storage.backend import Batch, Storage, StorageError
from fila.storage.recent import RecentRecords
from fila.storage.thread_priority import raise_current_thread
from fila.telemetry.histogram import FSYNC_BOUNDS_S, FixedHistogram

log = logging.getLogger("fila.storage")

# The longest a `sync_soon` write waits for a sync that something else asks for.
SYNC_SOON_S = 0.005


class Gate(Protocol):
    """What a batch's writers wait on besides its fsync (see the module docstring)."""

    def synced(self) -> None:
        """The batch is durable here."""
        ...

    def when_answered(self, callback: Callable[[Exception | None], None]) -> None:
        """`callback(None)` once the writers may be answered, or with why not."""
        ...

    def when_replicated(self, callback: Callable[[], None]) -> None:
        """`callback()` once what the batch made ready may be served (never, if it
        never may)."""
        ...


# (the batch about to be written, the queue each of its operations belongs to) ->
# a gate, or None when nothing in it waits on anything but the fsync
BatchHook = Callable[[Batch, list["str | None"]], "Gate | None"]


class Committer:
    """Collects writes into one open batch; commits it once per event-loop turn."""

    def __init__(
        self,
        storage: Storage,
        mode: PersistMode,
        on_failure: Callable[[StorageError], None],
        fsync_priority_boost: int = 0,
        *,
        recent_bytes: int = 0,
    ) -> None:
        """`recent_bytes`: the budget of `recent`, message records kept for delivery
        (`fila.storage.recent`); 0 keeps none."""
        self._storage = storage
        self.recent = RecentRecords(recent_bytes)
        self._sync = mode == "sync"
        self._fsync_priority_boost = fsync_priority_boost
        self._on_failure = on_failure
        self._batch = Batch()
        self._tags: list[str | None] = []  # the queue of each operation in `_batch`
        self._hook: BatchHook | None = None
        self._ops = 0
        self._future: asyncio.Future[None] | None = None
        self._after: list[Callable[[], None]] = []
        self._durable: list[Callable[[], None]] = []
        self._scheduled = False
        # `sync_soon`: asked for in the open batch; written and not yet covered by a
        # sync; its timer; and that timer fired while a sync was running.
        self._soon_open = False
        self._soon_unsynced = False
        self._soon_timer: asyncio.TimerHandle | None = None
        self._soon_overdue = False
        self._failed: StorageError | None = None
        # Written to the WAL but not yet fsynced, oldest first; and whether a sync runs.
        self._unsynced: list[_Waiters] = []
        self._syncing = False
        self._sync_requests: queue.SimpleQueue[_SyncRequest | None] = queue.SimpleQueue()
        self._fsync_thread: threading.Thread | None = None  # started by the first sync
        self._closed = False
        self.batches_written = 0
        self.ops_written = 0
        self.syncs = 0
        # Seconds each WAL fsync took (fila.storage.fsync.duration), recorded where the
        # fsync runs (the fsync thread; the loop at recovery and shutdown).
        self.fsync_seconds = FixedHistogram(FSYNC_BOUNDS_S)

    def put(self, key: bytes, value: bytes, queue: str | None = None) -> None:
        """Writes `key` with the next batch; `queue`: the queue the record belongs to
        (what replication goes by), None for a node's own records."""
        self._batch.put(key, value)
        self._tags.append(queue)
        self.recent.wrote(key, value)
        self._touch()

    def delete(self, key: bytes, queue: str | None = None) -> None:
        self._batch.delete(key)
        self._tags.append(queue)
        self.recent.deleted(key)
        self._touch()

    def replicate(self, ops: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Writes another node's operations (a replica's) with the next batch: they
        belong to no queue this node serves, and none is kept for delivery."""
        batch, tags, recent = self._batch, self._tags, self.recent
        for key, value in ops:
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
            tags.append(None)
            recent.deleted(key)  # a record written here before is no longer current
            self._touch()

    def set_hook(self, hook: BatchHook | None) -> None:
        """The batch hook (see the module docstring); set before anything is written."""
        self._hook = hook

    def flushed(self) -> asyncio.Future[None]:
        """A future that resolves once everything written so far is committed."""
        if self._failed is not None:
            failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            failed.set_exception(self._failed)
            return failed
        if self._future is None:
            self._future = asyncio.get_running_loop().create_future()
            self._schedule()
        return self._future

    def sync_soon(self) -> None:
        """Makes everything written so far, and the open batch, durable with the next
        sync, which starts within `SYNC_SOON_S` if nothing else asks for one first (for
        writes nobody waits on; see the module docstring). No-op in buffer mode."""
        if self._sync:
            self._soon_open = True
            self._schedule()

    def after_commit(self, callback: Callable[[], None]) -> None:
        """Runs `callback` on the event loop once the open batch is committed."""
        self._after.append(callback)
        self._schedule()

    def when_durable(self, callback: Callable[[], None]) -> None:
        """Runs `callback` on the event loop once the open batch is durable here (its
        fsync), whatever else its writers wait for: a replica acknowledges its
        leader's batch then, not once this node's own writes are replicated."""
        self._durable.append(callback)
        self._schedule()

    def write_now(self) -> None:
        """Appends the open batch to the WAL at once, instead of at the end of this turn.

        For a write that must be in the log before something leaves the process (a
        lease before its message goes out), without waiting for an fsync."""
        if self._ops:
            self._write_batch()

    def flush_now(self) -> None:
        """Writes and fsyncs everything pending, synchronously (recovery and shutdown)."""
        self._write_batch(start_sync=False)
        if self._failed is None and self._sync:
            self._finish_sync(self._take_unsynced(), self._fsync())

    def close(self) -> None:
        """Waits for a sync in flight to end; a sync asked for later fails."""
        self._closed = True
        if self._fsync_thread is not None:
            self._sync_requests.put(None)
            self._fsync_thread.join()
            self._fsync_thread = None

    def _touch(self) -> None:
        self._ops += 1
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._write_batch)

    def _write_batch(self, start_sync: bool = True) -> None:
        """Appends the open batch to the WAL (no fsync, a few microseconds) and starts a sync."""
        self._scheduled = False
        soon, self._soon_open = self._soon_open, False
        batch, ops, tags = self._batch, self._ops, self._tags
        waiters = _Waiters(self._future, self._after)
        waiters.durable = self._durable
        self._batch = Batch()
        self._tags = []
        self._ops = 0
        self._future = None
        self._after = []
        self._durable = []
        if self._failed is None and ops:
            if self._hook is not None:
                waiters.gate = self._hook(batch, tags)
            try:
                self._storage.write(batch)
            except StorageError as exc:
                self._fail(exc)
            else:
                self.batches_written += 1
                self.ops_written += ops
        if self._failed is not None:
            waiters.fail(self._failed)
            return
        if not self._sync or not (ops or self._syncing or self._unsynced or self._soon_unsynced):
            # Buffer mode; or nothing written and nothing left unsynced, so everything
            # written so far is durable already: no fsync for nothing (a request whose
            # every item failed would otherwise cost one, and a client could loop them).
            waiters.succeed()
            return
        if soon:
            self._soon_unsynced = True  # until a sync starts after this write
        if waiters:
            self._unsynced.append(waiters)
            if start_sync and not self._syncing:
                self._start_sync()
        if start_sync and self._soon_unsynced and self._soon_timer is None:
            loop = asyncio.get_running_loop()
            self._soon_timer = loop.call_later(SYNC_SOON_S, self._sync_soon_due)

    def _sync_soon_due(self) -> None:
        """A `sync_soon` write waited `SYNC_SOON_S`: sync now, or after the running sync
        (which may have started before the write)."""
        self._soon_timer = None
        if not self._soon_unsynced or self._failed is not None or self._closed:
            return
        if self._syncing:
            self._soon_overdue = True
        else:
            self._start_sync()

    def _start_sync(self) -> None:
        """Fsyncs the WAL on a thread: flush_wal releases the GIL, so the loop keeps serving
        and whatever arrives meanwhile forms the next group.

        The thread is our own, fed by a `SimpleQueue` and answering with one
        `call_soon_threadsafe`, rather than an executor: `run_in_executor`'s two chained
        futures cost the saturated core measurable time per message (docs/benchmarks.md),
        for nothing a single worker needs."""
        covered = self._take_unsynced()
        if self._closed:
            self._finish_sync(covered, StorageError("WAL sync asked for after shutdown"))
            return
        self._syncing = True
        if self._fsync_thread is None:
            self._fsync_thread = threading.Thread(
                target=self._sync_loop, name="fila-fsync", daemon=True
            )
            self._fsync_thread.start()
        self._sync_requests.put((asyncio.get_running_loop(), covered))

    def _sync_loop(self) -> None:
        """The fsync thread: one sync per request, its outcome handed straight to the loop."""
        self._raise_priority()
        while (request := self._sync_requests.get()) is not None:
            loop, covered = request
            error = self._fsync()
            try:
                loop.call_soon_threadsafe(self._sync_done, covered, error)
            except RuntimeError:  # the loop is closed: nothing waits on this sync any more
                return

    def _raise_priority(self) -> None:
        """Called on the fsync thread itself: Linux gives each thread its own nice value."""
        if self._fsync_priority_boost <= 0:
            return
        outcome = raise_current_thread(self._fsync_priority_boost)
        if outcome.refused:
            log.info(
                "the WAL fsync thread runs at the broker's own priority",
                extra={
                    "reason": outcome.refused,
                    "setting": "storage.fsync_priority_boost (0 asks for nothing)",
                },
            )
        else:
            log.debug("WAL fsync thread priority raised", extra={"nice": outcome.after})

    def _fsync(self) -> StorageError | None:
        started = time.perf_counter()
        try:
            self._storage.sync()
        except StorageError as exc:
            return exc
        finally:
            self.fsync_seconds.record(time.perf_counter() - started)
        return None

    def _sync_done(self, covered: list[_Waiters], error: StorageError | None) -> None:
        self._syncing = False
        self._finish_sync(covered, error)
        if self._failed is not None:
            # what was written while it ran will never be synced: its writers hear why
            for waiters in self._take_unsynced():
                waiters.fail(self._failed)
        elif self._unsynced or self._soon_overdue:
            self._start_sync()

    def _finish_sync(self, covered: list[_Waiters], error: StorageError | None) -> None:
        self.syncs += 1
        if error is not None:
            self._fail(error)
        for waiters in covered:
            if self._failed is not None:
                waiters.fail(self._failed)
            else:
                waiters.succeed()

    def _take_unsynced(self) -> list[_Waiters]:
        """What the sync about to run covers: every waiter written so far, and with them
        every `sync_soon` write."""
        taken, self._unsynced = self._unsynced, []
        self._soon_unsynced = self._soon_overdue = False
        return taken

    def _fail(self, exc: StorageError) -> None:
        if self._failed is None:
            self._failed = exc
            log.critical("storage write failed, stopping", extra={"error": str(exc)})
            self._on_failure(self._failed)


_SyncRequest = tuple[asyncio.AbstractEventLoop, list["_Waiters"]]


class _Waiters:
    """Everything waiting on one batch: the shared future and after-commit callbacks,
    and the batch's gate (see the module docstring), if it has one."""

    __slots__ = ("after", "durable", "future", "gate")

    def __init__(self, future: asyncio.Future[None] | None, after: list[Callable[[], None]]):
        self.future = future
        self.after = after
        self.durable: list[Callable[[], None]] = []
        self.gate: Gate | None = None

    def __bool__(self) -> bool:
        return (
            self.future is not None
            or bool(self.after)
            or bool(self.durable)
            or self.gate is not None
        )

    def succeed(self) -> None:
        for callback in self.durable:
            callback()
        gate = self.gate
        if gate is not None:
            gate.synced()
            after, future = self.after, self.future
            if after:
                gate.when_replicated(lambda: _run(after))
            if future is not None:
                gate.when_answered(lambda error: _settle(future, error))
            return
        for callback in self.after:
            callback()
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

    def fail(self, error: StorageError) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_exception(error)
            self.future.exception()  # mark retrieved: every waiter reports it itself


def _run(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()


def _settle(future: asyncio.Future[None], error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
        future.exception()  # mark retrieved: every waiter reports it itself
