"""Every node's local copy of the cluster state in etcd, kept current by one watch.

Routing reads placement and membership on every call, and authentication reads API
keys, so they must be local: a read from memory, never a round trip to etcd. The
`Mirror` reads everything under the cluster prefix once (a snapshot at revision S),
then watches from S + 1 and hands each change to the `Section` that owns that part
of the layout (`fila.cluster.layout`): nodes, placements, config, keys.

Changes reach a section from three sources: the watch, snapshots (at startup, after a
lost watch, and the targeted `refresh` reads below), and a node's own writes, applied
as soon as etcd answers them (so the node that wrote a value reads it back at once).
They can arrive out of order, so each key remembers the revision of the state it
shows, and an older state never replaces a newer one.

A watch lags etcd by a few milliseconds. Where that would be visible (a queue
created through node A and used through node B at once, a key created on A and
presented to B), the caller asks for a `refresh` of the one key first: a
linearizable read, so whatever etcd had answered before the call began is seen.
Concurrent refreshes of one key share a read, but never one that started before the
caller arrived (it could predate the write the caller depends on).

Test seam: `FILA_CLUSTER_WATCH_DELAY_MS` (environment, tests only) holds each watched
change back that long before it is applied, so that a test can show a property that
must not depend on the watch being quick (read-your-writes across nodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

from fila.cluster.etcd import Etcd, EtcdUnavailable, Snapshot, WatchLost

log = logging.getLogger("fila.cluster")

# Deleted keys keep their revision (so a late older write cannot resurrect them) up to
# this many; past it the oldest half is forgotten.
MAX_TOMBSTONES: Final = 100_000
RESYNC_BACKOFF_S: Final = (0.1, 2.0)
WATCH_DELAY_ENV: Final = "FILA_CLUSTER_WATCH_DELAY_MS"


class Section(Protocol):
    """One part of the layout mirrored into local state; `name` is the key below the
    section's prefix. Both calls must be idempotent and must not raise for bad values
    (log them: one bad record must not stop a node)."""

    def put(self, name: str, value: bytes) -> None: ...

    def delete(self, name: str) -> None: ...


@dataclass(slots=True)
class _Read:
    started: int
    future: asyncio.Future[None] = field(repr=False)


class Mirror:
    def __init__(self, etcd: Etcd, root: str) -> None:
        self._etcd = etcd
        self.root = root
        self._sections: dict[str, Section] = {}
        self._revisions: dict[str, int] = {}  # key -> revision of the state applied
        self._present: set[str] = set()
        self._tombstones = 0
        self._seq = itertools.count()
        self._reads: dict[str, _Read] = {}
        self._read_tasks: set[asyncio.Task[None]] = set()
        self._watch_delay_s = int(os.environ.get(WATCH_DELAY_ENV) or 0) / 1000

    def add(self, section_name: str, section: Section) -> None:
        """Routes keys under `root + section_name` (e.g. "queues/") to `section`."""
        self._sections[section_name] = section

    # -- applying state ----------------------------------------------------------------

    def apply(self, key: str, value: bytes | None, revision: int) -> None:
        """Applies `key`'s state at `revision` (None: deleted), unless newer is known."""
        if revision <= self._revisions.get(key, 0):
            return
        routed = self._route(key)
        if routed is None:
            return
        section, name = routed
        self._revisions[key] = revision
        if value is None:
            if key in self._present:
                self._present.discard(key)
                self._note_tombstone()
            section.delete(name)
        else:
            self._present.add(key)
            section.put(name, value)

    def load(self, snapshot: Snapshot, prefix: str) -> None:
        """Applies a snapshot of everything under `prefix`: its entries, and the
        deletion of keys under `prefix` it lacks (unless known newer than it)."""
        seen = set()
        for entry in snapshot.entries:
            seen.add(entry.key)
            self.apply(entry.key, entry.value, entry.mod_revision)
        gone = [k for k in self._present if k.startswith(prefix) and k not in seen]
        for key in gone:
            if self._revisions.get(key, 0) < snapshot.revision:
                self.apply(key, None, snapshot.revision)

    def _route(self, key: str) -> tuple[Section, str] | None:
        if not key.startswith(self.root):
            return None
        rest = key[len(self.root) :]
        head, sep, name = rest.partition("/")
        section = self._sections.get(head + sep)
        return None if section is None or not name else (section, name)

    def _note_tombstone(self) -> None:
        self._tombstones += 1
        if self._tombstones <= MAX_TOMBSTONES:
            return
        dead = sorted(
            (rev, key) for key, rev in self._revisions.items() if key not in self._present
        )
        for _rev, key in dead[: len(dead) // 2]:
            del self._revisions[key]
        self._tombstones = len(dead) - len(dead) // 2

    # -- reads through to etcd ---------------------------------------------------------

    async def snapshot(self) -> int:
        """Reads and applies everything under the root; returns the snapshot revision."""
        snapshot = await self._etcd.get_prefix(self.root)
        self.load(snapshot, self.root)
        return snapshot.revision

    async def refresh(self, key: str) -> None:
        """Makes `key`'s local state at least as new as etcd's when this call began
        (see the module docstring). Raises EtcdUnavailable."""
        await self._shared_read(key, lambda: self._read_key(key))

    async def refresh_prefix(self, prefix: str) -> None:
        """`refresh` for everything under `prefix` (one range read)."""
        await self._shared_read(prefix + "\0*", lambda: self._read_prefix(prefix))

    async def _read_key(self, key: str) -> None:
        entry, revision = await self._etcd.get(key)
        if entry is not None:
            self.apply(key, entry.value, entry.mod_revision)
        elif key in self._present:
            self.apply(key, None, revision)

    async def _read_prefix(self, prefix: str) -> None:
        self.load(await self._etcd.get_prefix(prefix), prefix)

    async def _shared_read(self, name: str, read: Callable[[], Awaitable[None]]) -> None:
        arrived = next(self._seq)
        while True:
            current = self._reads.get(name)
            if current is not None and current.started > arrived:
                await asyncio.shield(current.future)
                return
            if current is not None:  # began before this caller: wait it out, then read
                await asyncio.wait((current.future,))
                continue
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._reads[name] = _Read(next(self._seq), future)
            task = asyncio.create_task(self._run_read(name, future, read))
            self._read_tasks.add(task)
            task.add_done_callback(self._read_tasks.discard)
            await asyncio.shield(future)
            return

    async def _run_read(
        self, name: str, future: asyncio.Future[None], read: Callable[[], Awaitable[None]]
    ) -> None:
        try:
            await read()
        except EtcdUnavailable as exc:
            future.set_exception(exc)
        except BaseException as exc:
            future.set_exception(EtcdUnavailable(f"etcd read failed: {exc!r}"))
            raise
        else:
            future.set_result(None)
        finally:
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: a read nobody awaits any more is fine
            self._reads.pop(name, None)

    # -- the watch -----------------------------------------------------------------------

    async def run(self, revision: int) -> None:
        """Watches from `revision` + 1 (the snapshot the node started from) forever.
        A lost watch is followed by a new snapshot; etcd being unreachable is waited out
        (the lease, not the mirror, decides whether this node may serve)."""
        backoff = RESYNC_BACKOFF_S[0]
        while True:
            try:
                async for changes in self._etcd.watch(self.root, revision + 1):
                    if self._watch_delay_s:
                        await asyncio.sleep(self._watch_delay_s)  # the test seam above
                    for change in changes:
                        self.apply(change.key, change.value, change.revision)
                    revision = max(revision, changes[-1].revision)
                    backoff = RESYNC_BACKOFF_S[0]
                log.warning("etcd ended the watch of %s; reading a new snapshot", self.root)
            except (EtcdUnavailable, WatchLost) as exc:
                log.warning("cluster state watch lost, resynchronizing: %s", exc)
            while True:
                try:
                    revision = await self.snapshot()
                    break
                except EtcdUnavailable as exc:
                    log.warning("cluster state snapshot failed, retrying: %s", exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RESYNC_BACKOFF_S[1])

    async def close(self) -> None:
        for task in list(self._read_tasks):
            task.cancel()
        for task in list(self._read_tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
