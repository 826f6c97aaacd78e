"""The group committer's sync-mode contract, in-process over memory storage.

The fsync-before-answer proof against a real broker is `test_fsync.py` (strace);
these pin down the committer's own rules, which that proof cannot isolate: a
writer is answered only once a sync that *started after its write* has ended;
writes that arrive during a sync share the next one; a write nobody waits on
(`sync_soon`) rides the next sync, or gets one of its own after `SYNC_SOON_S`; a sync
error reaches every waiter and stops the broker; closing waits for the sync in flight, and a sync
asked for after closing fails instead of leaving its writers waiting forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest

from fila.config import PersistMode
from fila.storage import committer as committer_module
from fila.storage import keys
from fila.storage.backend import Batch, MemoryStorage, StorageError
from fila.storage.committer import Committer
from fila.storage.thread_priority import PriorityOutcome
from tests.support import until

DEADLINE_S = 10.0


class GatedStorage(MemoryStorage):
    """Memory storage whose `sync` blocks until the test opens the gate, on the fsync thread."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Semaphore(0)
        self.fail_with: StorageError | None = None
        self.writes_at_sync: list[int] = []

    def sync(self) -> None:
        self.writes_at_sync.append(self.writes)
        self.entered.release()
        if not self.gate.wait(DEADLINE_S):
            raise AssertionError("the test never opened the sync gate")
        if self.fail_with is not None:
            raise self.fail_with
        super().sync()


def in_loop(test: Callable[[], Awaitable[None]]) -> Callable[[], None]:
    """Runs an async test in a fresh event loop (the committer needs a running one)."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


@contextlib.contextmanager
def gated_committer(
    mode: PersistMode = "sync", on_failure: Callable[[StorageError], None] = lambda exc: None
) -> Iterator[tuple[GatedStorage, Committer]]:
    """A committer over gated storage; the gate is opened at the end so no sync is left blocked."""
    storage = GatedStorage()
    committer = Committer(storage, mode, on_failure)
    try:
        yield storage, committer
    finally:
        storage.gate.set()
        committer.close()


async def _write_held_in_sync(
    storage: GatedStorage, committer: Committer, key: bytes
) -> asyncio.Future[None]:
    """Writes `key` and waits (off the loop, with a deadline) until the fsync thread is
    inside the `sync` that covers it; returns the writer's future."""
    committer.put(key, b"v")
    done = committer.flushed()
    entered = await asyncio.to_thread(storage.entered.acquire, True, DEADLINE_S)
    assert entered, "no sync started"
    return done


@in_loop
async def test_a_writer_is_answered_only_after_a_sync_that_covers_its_write() -> None:
    with gated_committer() as (storage, committer):
        done = await _write_held_in_sync(storage, committer, b"k")
        assert storage.writes_at_sync == [1]  # written to the WAL before the sync began
        await asyncio.sleep(0)  # give a wrong answer every chance to arrive
        assert not done.done()
        storage.gate.set()
        await asyncio.wait_for(done, DEADLINE_S)
        assert storage.sync_count == 1
        assert storage.get(b"k") == b"v"


@in_loop
async def test_writes_during_a_sync_share_the_next_sync() -> None:
    with gated_committer() as (storage, committer):
        first = await _write_held_in_sync(storage, committer, b"first")
        later = []
        for i in range(5):  # five loop turns, five WAL writes, while the first sync runs
            committer.put(b"later-%d" % i, b"x")
            later.append(committer.flushed())
            await asyncio.sleep(0)
        assert storage.writes == 6
        assert not any(f.done() for f in later)
        storage.gate.set()
        await asyncio.wait_for(first, DEADLINE_S)
        await asyncio.wait_for(asyncio.gather(*later), DEADLINE_S)
        assert storage.sync_count == 2  # one group for all five
        assert storage.writes_at_sync == [1, 6]
        assert committer.syncs == 2


@in_loop
async def test_a_failed_sync_fails_every_waiter_and_stops_the_broker() -> None:
    failures: list[StorageError] = []
    with gated_committer(on_failure=failures.append) as (storage, committer):
        storage.fail_with = StorageError("WAL sync failed: disk gone")
        committer.put(b"k", b"v")
        done = committer.flushed()
        storage.gate.set()
        with pytest.raises(StorageError, match="disk gone"):
            await asyncio.wait_for(done, DEADLINE_S)
        assert [str(f) for f in failures] == ["WAL sync failed: disk gone"]
        committer.put(b"after", b"v")  # the broker refuses to go on as if written
        with pytest.raises(StorageError, match="disk gone"):
            await asyncio.wait_for(committer.flushed(), DEADLINE_S)


@in_loop
async def test_a_failed_wal_write_fails_its_writers_and_stops_the_broker() -> None:
    failures: list[StorageError] = []
    with gated_committer(on_failure=failures.append) as (storage, committer):
        error = StorageError("WAL write failed: disk full")

        def write(batch: Batch) -> None:
            raise error

        storage.write = write  # type: ignore[method-assign]
        committer.put(b"k", b"v")
        with pytest.raises(StorageError, match="disk full"):
            await asyncio.wait_for(committer.flushed(), DEADLINE_S)
        assert failures == [error] and committer.batches_written == 0
        with pytest.raises(StorageError, match="disk full"):
            await asyncio.wait_for(committer.flushed(), DEADLINE_S)


@in_loop
async def test_batches_and_operations_written_are_counted_once_each() -> None:
    """What the storage metrics report: one batch per loop turn with writes (a turn
    with only after-commit work writes none), and every put and delete in it."""
    storage = MemoryStorage()
    committer = Committer(storage, "buffer", lambda exc: None)
    committer.put(b"a", b"v")
    committer.put(b"b", b"v")
    committer.delete(b"a")
    await asyncio.wait_for(committer.flushed(), DEADLINE_S)
    ran: list[bool] = []
    committer.after_commit(lambda: ran.append(True))
    await until(lambda: ran, "the after-commit work ran", DEADLINE_S)
    committer.put(b"c", b"v")
    committer.delete(b"b")
    await asyncio.wait_for(committer.flushed(), DEADLINE_S)
    assert (committer.batches_written, committer.ops_written, storage.writes) == (2, 5, 2)


@in_loop
async def test_close_waits_for_the_sync_in_flight() -> None:
    storage = GatedStorage()
    committer = Committer(storage, "sync", lambda exc: None)
    done = await _write_held_in_sync(storage, committer, b"k")
    closing = asyncio.create_task(asyncio.to_thread(committer.close))
    await asyncio.sleep(0.05)  # close must still be waiting: the sync has not ended
    assert not closing.done()
    storage.gate.set()
    await asyncio.wait_for(closing, DEADLINE_S)
    assert storage.sync_count == 1
    await asyncio.wait_for(done, DEADLINE_S)  # the loop still hears of the sync


@in_loop
async def test_a_sync_asked_for_after_close_fails_instead_of_hanging() -> None:
    storage = GatedStorage()
    storage.gate.set()
    failures: list[StorageError] = []
    committer = Committer(storage, "sync", failures.append)
    committer.put(b"k", b"v")
    await asyncio.wait_for(committer.flushed(), DEADLINE_S)
    committer.close()
    committer.put(b"late", b"v")
    with pytest.raises(StorageError, match=r"^WAL sync asked for after shutdown$"):
        await asyncio.wait_for(committer.flushed(), DEADLINE_S)
    assert len(failures) == 1


@in_loop
async def test_buffer_mode_answers_after_the_wal_write_without_a_sync() -> None:
    # the gate stays shut until the end: a sync would block until the deadline
    with gated_committer("buffer") as (storage, committer):
        committer.put(b"k", b"v")
        await asyncio.wait_for(committer.flushed(), DEADLINE_S)
        assert storage.writes == 1
        assert storage.writes_at_sync == []


@pytest.mark.parametrize(("mode", "syncs"), [("sync", 1), ("buffer", 0)])
def test_flush_now_writes_and_fsyncs_what_is_pending_and_answers_its_writers(
    mode: PersistMode, syncs: int
) -> None:
    """Recovery and shutdown commit synchronously: everything pending is written (and
    in sync mode fsynced, once) before `flush_now` returns, and the writers waiting on
    it are answered by then."""

    async def test() -> None:
        storage = MemoryStorage()
        committer = Committer(storage, mode, lambda exc: None)
        try:
            committer.put(b"k", b"v")
            done = committer.flushed()
            committer.flush_now()
            assert (storage.get(b"k"), storage.sync_count, done.done()) == (b"v", syncs, True)
            await asyncio.sleep(0)
            assert storage.sync_count == syncs, "no sync of its own in the background"
        finally:
            committer.close()

    asyncio.run(test())


# -- sync_soon: writes nobody waits on ride the next sync ----------------------------


@in_loop
async def test_waiting_with_nothing_written_and_nothing_unsynced_costs_no_sync() -> None:
    """A writer that wrote nothing (a request whose every item failed) while nothing
    is left unsynced is answered without an fsync of its own: one would sync nothing,
    and a client could ask for them in a loop."""
    with gated_committer() as (storage, committer):
        storage.gate.set()
        committer.put(b"k", b"v")
        await asyncio.wait_for(committer.flushed(), DEADLINE_S)
        assert storage.sync_count == 1
        ran: list[str] = []
        committer.after_commit(lambda: ran.append("after"))
        await asyncio.wait_for(committer.flushed(), DEADLINE_S)
        assert ran == ["after"] and storage.sync_count == 1


@in_loop
async def test_waiting_with_nothing_written_during_a_sync_waits_for_a_sync_after_it() -> None:
    """The sync running covers a write that is not durable yet: a writer that wrote
    nothing meanwhile still waits for a sync to end."""
    with gated_committer() as (storage, committer):
        first = await _write_held_in_sync(storage, committer, b"k")
        nothing = committer.flushed()
        for _ in range(3):
            await asyncio.sleep(0)
        assert not nothing.done()
        storage.gate.set()
        await asyncio.wait_for(asyncio.gather(first, nothing), DEADLINE_S)


def test_waiting_with_nothing_written_still_waits_for_unsynced_writes(
    soon_s: Callable[[float], None],
) -> None:
    """Nothing written now, but a `sync_soon` write is in the WAL unsynced: the waiter
    is answered only once a sync covers it."""
    soon_s(DEADLINE_S * 10)  # its own timer never fires within the test

    async def test() -> None:
        with gated_committer() as (storage, committer):
            committer.put(b"ack", b"")
            committer.sync_soon()
            await asyncio.sleep(0)
            assert storage.writes == 1 and storage.sync_count == 0
            waiting = committer.flushed()
            entered = await asyncio.to_thread(storage.entered.acquire, True, DEADLINE_S)
            assert entered, "no sync started"
            assert not waiting.done()
            storage.gate.set()
            await asyncio.wait_for(waiting, DEADLINE_S)
            assert storage.sync_count == 1

    asyncio.run(test())


@pytest.fixture
def soon_s(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Sets how long a `sync_soon` write waits for a sync asked for by something else."""
    return lambda seconds: monkeypatch.setattr(committer_module, "SYNC_SOON_S", seconds)


def test_a_sync_soon_write_rides_the_sync_of_the_next_answered_write(
    soon_s: Callable[[float], None],
) -> None:
    soon_s(DEADLINE_S * 10)  # its own timer never fires within the test

    async def test() -> None:
        with gated_committer() as (storage, committer):
            committer.put(b"ack", b"")
            committer.sync_soon()
            for _ in range(3):
                await asyncio.sleep(0)
            assert storage.writes == 1  # written to the WAL at the end of its turn
            assert storage.writes_at_sync == []  # but no sync of its own
            answered = await _write_held_in_sync(storage, committer, b"enqueue")
            assert storage.writes_at_sync == [2]  # one sync for both
            storage.gate.set()
            await asyncio.wait_for(answered, DEADLINE_S)
            assert storage.sync_count == 1

    asyncio.run(test())


def test_a_lone_sync_soon_write_gets_a_sync_of_its_own(soon_s: Callable[[float], None]) -> None:
    soon_s(0)

    async def test() -> None:
        with gated_committer() as (storage, committer):
            storage.gate.set()
            committer.put(b"ack", b"")
            committer.sync_soon()
            await until(lambda: storage.sync_count == 1, "the sync_soon write synced", DEADLINE_S)
            assert storage.writes_at_sync == [1]

    asyncio.run(test())


def test_a_sync_soon_write_during_a_sync_gets_the_next_one(
    soon_s: Callable[[float], None],
) -> None:
    """The sync running when it was written may have started before it: it is covered
    only by a sync that starts later, even with nothing else asking for one."""
    soon_s(0)

    async def test() -> None:
        with gated_committer() as (storage, committer):
            first = await _write_held_in_sync(storage, committer, b"enqueue")
            committer.put(b"ack", b"")
            committer.sync_soon()
            for _ in range(3):  # its timer (due at once) runs while the sync is held
                await asyncio.sleep(0)
            assert storage.writes_at_sync == [1]
            storage.gate.set()
            await asyncio.wait_for(first, DEADLINE_S)
            await until(lambda: storage.sync_count == 2, "a second sync", DEADLINE_S)
            assert storage.writes_at_sync == [1, 2]

    asyncio.run(test())


def test_every_lone_sync_soon_write_gets_a_sync_of_its_own(
    soon_s: Callable[[float], None],
) -> None:
    """Not only the first: the timer is armed again for the next one."""
    soon_s(0)

    async def test() -> None:
        with gated_committer() as (storage, committer):
            storage.gate.set()
            for count in (1, 2, 3):
                committer.put(b"ack-%d" % count, b"")
                committer.sync_soon()
                await until(
                    lambda n=count: storage.sync_count == n,
                    f"sync {count}",
                    DEADLINE_S,
                )

    asyncio.run(test())


def test_a_sync_soon_write_covered_by_another_sync_starts_none_of_its_own(
    soon_s: Callable[[float], None],
) -> None:
    """Its timer, firing after a sync that started after the write, has nothing to do."""
    soon_s(0.5)

    async def test() -> None:
        with gated_committer() as (storage, committer):
            committer.put(b"ack", b"")
            committer.sync_soon()
            for _ in range(3):
                await asyncio.sleep(0)
            answered = await _write_held_in_sync(storage, committer, b"enqueue")
            assert storage.writes_at_sync == [2]  # the ack's write is covered
            await asyncio.sleep(1.0)  # the ack's timer (due at 0.5 s) fires first
            storage.gate.set()
            await asyncio.wait_for(answered, DEADLINE_S)
            committer.put(b"next", b"")
            await asyncio.wait_for(committer.flushed(), DEADLINE_S)
            assert storage.writes_at_sync == [2, 3], "no sync for the ack alone"

    asyncio.run(test())


@in_loop
async def test_sync_soon_in_buffer_mode_syncs_nothing() -> None:
    with gated_committer("buffer") as (storage, committer):
        committer.put(b"ack", b"")
        committer.sync_soon()
        await asyncio.wait_for(committer.flushed(), DEADLINE_S)
        assert (storage.writes, storage.writes_at_sync) == (1, [])


# -- work that waits on a batch without a writer -------------------------------------


@pytest.mark.parametrize("register", ["after_commit", "when_durable"])
def test_work_registered_on_a_batch_with_no_writer_runs_once_the_batch_is_synced(
    register: str,
) -> None:
    """A batch whose only waiter is after-commit (or durable) work is synced like any
    other, and the work runs only then."""

    async def test() -> None:
        ran: list[str] = []
        with gated_committer() as (storage, committer):
            committer.put(b"k", b"v")
            getattr(committer, register)(lambda: ran.append(register))
            entered = await asyncio.to_thread(storage.entered.acquire, True, DEADLINE_S)
            assert entered, "no sync started for the batch"
            await asyncio.sleep(0)
            assert ran == []
            storage.gate.set()
            await until(lambda: ran == [register], "the work ran after the sync", DEADLINE_S)

    asyncio.run(test())


@in_loop
async def test_a_failed_sync_reaches_the_waiters_written_while_it_ran() -> None:
    """Writes that arrived during the sync that failed are never synced: their writers
    hear of the failure too (also after a batch nobody awaited), instead of waiting
    for an answer that never comes."""
    failures: list[StorageError] = []
    with gated_committer(on_failure=failures.append) as (storage, committer):
        first = await _write_held_in_sync(storage, committer, b"first")
        ran: list[str] = []
        committer.put(b"unawaited", b"v")
        committer.after_commit(lambda: ran.append("after"))  # no writer awaits this batch
        await asyncio.sleep(0)
        committer.put(b"awaited", b"v")
        later = committer.flushed()
        await asyncio.sleep(0)
        storage.fail_with = StorageError("WAL sync failed: disk gone")
        storage.gate.set()
        for done in (first, later):
            with pytest.raises(StorageError, match="disk gone"):
                await asyncio.wait_for(done, DEADLINE_S)
        assert ran == [] and len(failures) == 1


@in_loop
async def test_each_sync_is_timed_in_the_fsync_histogram() -> None:
    storage = MemoryStorage()
    committer = Committer(storage, "sync", lambda exc: None)
    try:
        started = time.perf_counter()
        committer.put(b"k", b"v")
        await asyncio.wait_for(committer.flushed(), DEADLINE_S)
        elapsed = time.perf_counter() - started
        timed = committer.fsync_seconds.snapshot()
        assert timed.count == 1 and 0 <= timed.total <= elapsed
    finally:
        committer.close()


@pytest.mark.parametrize("boost", [0, 1, 15])
def test_the_fsync_thread_asks_for_its_priority_boost_itself(
    boost: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux gives each thread its own nice value, so the boost is asked for on the
    fsync thread (`fila-fsync`, a daemon); a boost of 0 asks for nothing."""
    asked: list[tuple[int, str, bool]] = []

    def raise_current_thread(levels: int) -> PriorityOutcome:
        thread = threading.current_thread()
        asked.append((levels, thread.name, thread.daemon))
        return PriorityOutcome(0, -levels)

    monkeypatch.setattr(committer_module, "raise_current_thread", raise_current_thread)

    async def test() -> None:
        committer = Committer(MemoryStorage(), "sync", lambda exc: None, boost)
        try:
            committer.put(b"k", b"v")
            await asyncio.wait_for(committer.flushed(), DEADLINE_S)
        finally:
            committer.close()

    asyncio.run(test())
    assert asked == ([(boost, "fila-fsync", True)] if boost else [])


# -- the batch hook and its gate (cluster replication) ----------------------------


class RecordingGate:
    """A gate the test answers by hand; records what the committer told it."""

    def __init__(self) -> None:
        self.synced_count = 0
        self.answer: Callable[[Exception | None], None] | None = None
        self.replicated: Callable[[], None] | None = None

    def synced(self) -> None:
        self.synced_count += 1

    def when_answered(self, callback: Callable[[Exception | None], None]) -> None:
        self.answer = callback

    def when_replicated(self, callback: Callable[[], None]) -> None:
        self.replicated = callback


@in_loop
async def test_a_gated_batch_answers_writers_on_the_gates_answer_and_readies_on_replication() -> (
    None
):
    """The hook sees each batch with the queue of each operation; with a gate, durable
    work runs at the fsync, the writers wait for the gate's answer, and after-commit
    work (what becomes deliverable) for its `replicated`."""
    storage = MemoryStorage()
    committer = Committer(storage, "sync", lambda exc: None)
    seen: list[tuple[list[tuple[bytes, bytes | None]], list[str | None]]] = []
    gates: list[RecordingGate] = []

    def hook(batch: Batch, tags: list[str | None]) -> RecordingGate:
        seen.append((list(batch.ops), list(tags)))
        gates.append(RecordingGate())
        return gates[-1]

    committer.set_hook(hook)
    ran: list[str] = []
    try:
        committer.put(b"m", b"v", "q")
        committer.delete(b"n", "q")
        committer.put(b"node", b"v")
        done = committer.flushed()
        committer.after_commit(lambda: ran.append("ready"))
        committer.when_durable(lambda: ran.append("durable"))
        (gate,) = await _gates_synced(gates, 1)
        assert seen == [([(b"m", b"v"), (b"n", None), (b"node", b"v")], ["q", "q", None])]
        assert ran == ["durable"] and not done.done()
        assert gate.answer is not None and gate.replicated is not None
        gate.answer(None)
        await asyncio.wait_for(done, DEADLINE_S)
        assert ran == ["durable"]
        gate.replicated()
        assert ran == ["durable", "ready"]

        committer.put(b"m2", b"v", "q")
        refused = committer.flushed()
        _, gate = await _gates_synced(gates, 2)
        assert gate.answer is not None
        gate.answer(StorageError("no replica holds it"))
        with pytest.raises(StorageError, match="no replica"):
            await asyncio.wait_for(refused, DEADLINE_S)
    finally:
        committer.close()


async def _gates_synced(gates: list[RecordingGate], count: int) -> list[RecordingGate]:
    """The gates of the first `count` batches, once each of them is synced."""
    await until(
        lambda: len(gates) == count and all(g.synced_count == 1 for g in gates),
        f"{count} batches synced",
        DEADLINE_S,
    )
    return gates


@in_loop
async def test_replicated_operations_ride_the_next_batch_for_no_queue_and_are_not_kept() -> None:
    """A follower's copy of another node's writes: written in order with the next
    batch, under no queue of this node, and not kept for delivery (a record written
    here before is no longer current)."""
    storage = MemoryStorage()
    committer = Committer(storage, "buffer", lambda exc: None, recent_bytes=1 << 20)
    tags_seen: list[list[str | None]] = []

    def hook(batch: Batch, tags: list[str | None]) -> None:
        tags_seen.append(list(tags))

    a, gone, b, mine = (keys.MESSAGE + name for name in (b"a", b"gone", b"b", b"mine"))
    committer.set_hook(hook)
    committer.put(a, b"old", "q")
    committer.put(gone, b"v", "q")
    await asyncio.wait_for(committer.flushed(), DEADLINE_S)
    committer.put(mine, b"v", "q")
    committer.replicate([(a, b"new"), (gone, None), (b, b"v")])
    await asyncio.wait_for(committer.flushed(), DEADLINE_S)
    assert tags_seen == [["q", "q"], ["q", None, None, None]]
    assert (storage.get(a), storage.get(gone), storage.get(b)) == (b"new", None, b"v")
    assert committer.recent.take(a) is None and committer.recent.take(b) is None
    assert committer.recent.take(mine) == b"v"
