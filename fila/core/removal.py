"""Deleting many stored messages a chunk per loop turn (PurgeQueue, DeleteQueue).

A queue can hold millions of messages. Taking them out of memory is O(1): its ready
messages leave with their fairness keys (`Drr.detach`) and its delayed messages with
their map (`Queue.detach_delayed`), so from the call on no consumer is offered one of
them. Deleting their records is O(messages), so it runs in chunks of at most
`CHUNK_MESSAGES` records or `CHUNK_S` of work, each chunk one write, the next one
after that write is committed: the loop serves everyone else between chunks, and the
open write batch stays small. Keys given as `last` (DeleteQueue: the queue records) are
deleted in the final write, so a crash part-way leaves the queue as it would be had
the call deleted only the messages gone so far; it was not answered, and repeating it
finishes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from fila.core.drr import FairnessKey
from fila.core.errors import Unavailable
from fila.core.records import MessageRef
from fila.storage import keys
from fila.storage.committer import Committer

# A chunk (one turn of the event loop, one write) ends at whichever comes first.
CHUNK_MESSAGES = 2000
CHUNK_S = 0.002


@dataclass(slots=True)
class Detached:
    """One queue's messages taken out of memory, their records still stored.
    `ready` and `delayed` are the queue's former containers, owned by nobody else now
    (nothing changes them while their records are deleted)."""

    queue_name: str
    ready: Iterable[FairnessKey] = ()
    delayed: Iterable[MessageRef] = ()
    committing: Sequence[MessageRef] = field(default_factory=list)

    def storage_keys(self) -> Iterator[bytes]:
        """Every record to delete, lazily: the ready messages key by key, then the
        delayed ones and their delay records, then those whose write was committing."""
        for key in self.ready:
            key.next = key.prev = None  # no cycles left behind for the collector
            while key:
                yield key.popleft().key
        for ref in self.delayed:
            yield ref.key
            yield keys.delay_key(ref.key)
        for ref in self.committing:
            yield ref.key


async def delete_records(
    committer: Committer,
    doomed: Sequence[Detached],
    last: Sequence[tuple[bytes, str]],
    still_open: Callable[[], bool],
    what: str,
) -> None:
    """Deletes the records of `doomed`, then the keys of `last` (each with the queue
    name the write is tagged with), a chunk per committed write (see the module
    docstring). Raises Unavailable when the broker starts shutting down part-way."""
    for detached in doomed:
        tag = detached.queue_name
        pending = detached.storage_keys()
        exhausted = False
        while not exhausted:
            started = time.perf_counter()
            exhausted = True
            for count, key in enumerate(pending, 1):
                committer.delete(key, tag)
                if count >= CHUNK_MESSAGES or time.perf_counter() - started >= CHUNK_S:
                    exhausted = False
                    break
            await committer.flushed()
            if not still_open():
                raise Unavailable(
                    f"the broker is shutting down: the {what} stopped part-way; the "
                    "messages it had not deleted are back once the broker starts: repeat it"
                )
    for key, tag in last:
        committer.delete(key, tag)
    await committer.flushed()
