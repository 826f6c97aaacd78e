"""Administration: queues, stats, runtime config (and the throttles it drives),
redrive, peek and purge; and the restore calls recovery uses to rebuild state.

Answers are bounded so that a default client (4 MiB receive limit) can always
read them: stats list at most `MAX_LISTED_KEYS` keys (the largest backlogs),
config listings and peeks stop at `MAX_ANSWER_BYTES`; `total_count`,
`active_fairness_keys` and `next_after_id` tell the caller there is more.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from fila.core import removal, retry, stored
from fila.core.drr import FairnessKey
from fila.core.errors import (
    BrokerError,
    ConfigKeyNotFound,
    InvalidArgument,
    QueueAlreadyExists,
    QueueNotFound,
    ResourceExhausted,
    Unavailable,
    clip,
)
from fila.core.ids import parse_id
from fila.core.queue import (
    DEFAULT_VISIBILITY_TIMEOUT_MS,
    MAX_VISIBILITY_TIMEOUT_MS,
    Queue,
    QueueRecord,
    validate_queue_name,
)
from fila.core.records import MessageRef
from fila.core.runtime_config import ThrottleChange, validate_entry
from fila.core.stats import KeyStats, QueueStats
from fila.core.throttle import ThrottleStats
from fila.lua.hooks import QueueHooks
from fila.lua.sandbox import ScriptError
from fila.storage import keys
from fila.v1 import messages_pb2
from fila.wire import DLQ_SUFFIX, dlq_name, dlq_owner

if TYPE_CHECKING:
    from fila.core.delivery import Delivery
    from fila.core.settlement import Settlement
    from fila.core.state import CoreState

log = logging.getLogger("fila.broker")

MAX_LISTED_KEYS = 1000
# The QueueConfig fields UpdateQueue changes.
UPDATABLE = (
    "on_enqueue_script",
    "on_failure_script",
    "visibility_timeout_ms",
    "max_attempts",
    "retry_backoff",
)
MAX_ANSWER_BYTES = 3 * 1024 * 1024
DEFAULT_PEEK = 20
MAX_PEEK = 1000
# Delayed or leased messages of other fairness keys one filtered peek page may pass over.
PEEK_SCAN = 10_000
# Fairness keys a peek looks at per loop turn for the first ready messages of its page.
PEEK_KEYS_PER_TURN = 500
# Fairness keys GetStats weighs per loop turn for the largest it lists.
STATS_KEYS_PER_TURN = 10_000
# A redrive chunk (one turn of the event loop) ends at whichever comes first.
REDRIVE_CHUNK_MESSAGES = 1000
REDRIVE_CHUNK_BYTES = 4 * 1024 * 1024
REDRIVE_CHUNK_S = 0.002


class MessageState(enum.IntEnum):
    """A peeked message's state, numbered as `fila.v1.MessageState`."""

    READY = 1
    DELAYED = 2
    LEASED = 3


@dataclass(frozen=True, slots=True)
class PeekedState:
    """A peeked message's state; `ready_at_ms` for DELAYED and `lease_deadline_ms` for
    LEASED, on the broker's clock (0 otherwise)."""

    state: MessageState
    ready_at_ms: int
    lease_deadline_ms: int


def _ref_key(ref: MessageRef) -> bytes:
    return ref.key


class _ScanEnd(MessageRef):
    """Where a peek filtered by fairness key stopped passing over delayed or leased
    messages of other keys (`PEEK_SCAN` of them): the page ends there, short or even
    empty, with this message's id as `next_after_id`, so no page costs more than that."""

    __slots__ = ()


def _of_key(refs: Iterator[MessageRef], fairness_key: str) -> Iterator[MessageRef]:
    """`refs` of `fairness_key` (all of them when it is empty), then a `_ScanEnd` if
    `PEEK_SCAN` others were passed over first."""
    if not fairness_key:
        yield from refs
        return
    passed = 0
    for ref in refs:
        if ref.fairness_key == fairness_key:
            yield ref
            continue
        passed += 1
        if passed >= PEEK_SCAN:
            yield _ScanEnd(ref.key, "", 0, (), 0)
            return


def _visibility_timeout(wire_ms: int) -> int:
    """A wire visibility_timeout_ms (0: the default) checked against the limit."""
    timeout = wire_ms or DEFAULT_VISIBILITY_TIMEOUT_MS
    if timeout > MAX_VISIBILITY_TIMEOUT_MS:
        raise InvalidArgument(
            f"visibility_timeout_ms {timeout} is over the limit of {MAX_VISIBILITY_TIMEOUT_MS}"
        )
    return timeout


def dlq_record(queue: QueueRecord, created_at_ms: int) -> QueueRecord:
    """The record of `queue`'s dead-letter queue: no scripts, `queue`'s visibility timeout.

    The one derivation of a DLQ's configuration: CreateQueue uses it, and so does
    recovery when it recreates a DLQ whose record damage lost (`fila.core.recovery`),
    so that the DLQ it brings back is the one CreateQueue made."""
    return QueueRecord(
        dlq_name(queue.name), "", "", queue.visibility_timeout_ms, queue.name, created_at_ms
    )


class Administration:
    """Queue lifecycle, stats, runtime config, redrive, peek, purge and restore."""

    def __init__(self, state: CoreState, delivery: Delivery, settlement: Settlement) -> None:
        self.state = state
        self._delivery = delivery
        self._settlement = settlement
        # Queues whose records are still being deleted (a name comes free at the end).
        self._deleting: set[str] = set()
        # Purges and deletions under way, held here so that nothing can drop them.
        self._background: set[asyncio.Task[None]] = set()

    # -- queues --------------------------------------------------------------------

    def create_queue(
        self,
        name: str,
        on_enqueue: str,
        on_failure: str,
        visibility_timeout_ms: int,
        *,
        max_attempts: int = 0,
        retry_backoff: str = "",
    ) -> asyncio.Future[None]:
        """`max_attempts` and `retry_backoff` as on the wire (0 and "": the defaults)."""
        record, hooks, dlq_record = self._plan_create(
            name, on_enqueue, on_failure, visibility_timeout_ms, max_attempts, retry_backoff
        )
        committer = self.state.committer
        self._add_queue(record, hooks)
        committer.put(keys.queue_key(name), record.encode(), name)
        orphan = self.state.queues.get(dlq_record.name)
        if orphan is None:
            self._add_queue(dlq_record, None)
        else:
            # Its record takes the new queue's timeout, as a fresh DLQ would; its
            # messages stay where they are. The queue's own orphaned messages come back
            # at the next restart, when recovery finds their queue again.
            orphan.record = dlq_record
            log.warning(
                "queue created again: its orphaned dead-letter queue was kept, with its "
                "messages; restart the broker to bring back the queue's stored messages",
                extra={"queue": name, "dlq": dlq_record.name, "dlq_depth": orphan.depth},
            )
        committer.put(keys.queue_key(dlq_record.name), dlq_record.encode(), name)
        log.info("queue created", extra={"queue": name})
        return committer.flushed()

    def check_create(
        self,
        name: str,
        on_enqueue: str,
        on_failure: str,
        visibility_timeout_ms: int,
        *,
        max_attempts: int = 0,
        retry_backoff: str = "",
    ) -> None:
        """Every check `create_queue` makes (scripts compiled), creating nothing: cluster
        mode runs them before it claims the name in etcd."""
        self._plan_create(
            name, on_enqueue, on_failure, visibility_timeout_ms, max_attempts, retry_backoff
        )

    def _plan_create(
        self,
        name: str,
        on_enqueue: str,
        on_failure: str,
        visibility_timeout_ms: int,
        max_attempts: int,
        retry_backoff: str,
    ) -> tuple[QueueRecord, QueueHooks | None, QueueRecord]:
        self.state.check_open()
        validate_queue_name(name)
        if dlq_owner(name) is not None:
            raise InvalidArgument(
                f'queue name "{name}" ends with "{DLQ_SUFFIX}", which is reserved for '
                "dead-letter queues (creating a queue creates its own)"
            )
        queues = self.state.queues
        if name in queues:
            raise QueueAlreadyExists(name)
        if name in self._deleting:
            raise Unavailable(
                f'queue "{name}" is still being deleted; create it once DeleteQueue has answered'
            )
        orphan = queues.get(dlq_name(name))
        # An existing DLQ of `name` while `name` does not exist is an orphan: damage
        # (a repair that lost the queue's record but kept its DLQ's) left it, since
        # deleting a queue deletes its DLQ. Creating `name` adopts it, messages and
        # all: that is the documented way back ("create the queue again and
        # restart"), which refusing here would make impossible. It is `name`'s by its
        # name: recovery made its record say so (`fila.core.recovery._linked`).
        limit = self.state.settings.max_queues
        if len(queues) + (1 if orphan is not None else 2) > 2 * limit:
            raise ResourceExhausted(
                f"the broker holds {len(self.state.queues) // 2} queues, the limit is {limit} "
                "(server.max_queues)"
            )
        timeout = _visibility_timeout(visibility_timeout_ms)
        now = self.state.clock.now_ms()
        record = QueueRecord(
            name,
            on_enqueue,
            on_failure,
            timeout,
            "",
            now,
            max_attempts=retry.stored_max_attempts(max_attempts),
            retry_backoff=str(retry.Backoff.parse(retry_backoff)),
        )
        hooks = self._make_hooks(record)
        dlq_created_ms = orphan.record.created_at_ms if orphan is not None else now
        return record, hooks, dlq_record(record, dlq_created_ms)

    def delete_queue(self, name: str) -> asyncio.Future[None]:
        self.state.check_open()
        queue = self.state.queue(name)
        # A DLQ goes with its queue; one whose queue is gone (an orphan left by
        # damage, see `_plan_create`) has nothing to go with, so it may go alone.
        if queue.record.dlq_of in self.state.queues:
            raise InvalidArgument(
                f'queue "{name}" is the dead-letter queue of "{queue.record.dlq_of}"; '
                "delete that queue instead"
            )
        dlq_name = queue.dlq_name
        dlq = self.state.queues.get(dlq_name) if dlq_name else None
        gone = [queue] if dlq is None else [queue, dlq]
        doomed = [self._drop_queue(each) for each in gone]
        names = {each.name for each in gone}
        self._deleting |= names
        log.info("queue deleted", extra={"queue": name})
        # The queue records go last: a crash part-way leaves the queue, with what it
        # still holds, and its name stays taken until the records are gone.
        return self._in_background(
            removal.delete_records(
                self.state.committer,
                doomed,
                [(keys.queue_key(each.name), each.name) for each in gone],
                self._open,
                "deletion",
            ),
            then=lambda: self._deleting.difference_update(names),
        )

    def list_queues(self) -> list[Queue]:
        return sorted(self.state.queues.values(), key=lambda q: q.name)

    def get_queue(self, name: str) -> Queue:
        return self.state.queue(name)

    def update_queue(
        self, name: str, changes: Mapping[str, str | int]
    ) -> tuple[QueueRecord, asyncio.Future[None]]:
        """Changes the named fields of a queue's configuration (names and wire values
        as in `QueueConfig`), all checked (scripts compiled) before anything changes.
        Messages enqueued after this returns see the new configuration; leases already
        granted keep their deadlines. A DLQ has no hooks or retry policy of its own:
        only its visibility timeout can change."""
        self.state.check_open()
        queue = self.state.queue(name)
        unknown = sorted(changes.keys() - UPDATABLE)
        if unknown:
            raise InvalidArgument(
                f'cannot update "{clip(unknown[0])}": the fields are {", ".join(UPDATABLE)}'
            )
        if not changes:
            raise InvalidArgument(f"nothing to update: name a field ({', '.join(UPDATABLE)})")
        record = queue.record
        if record.dlq_of and changes.keys() - {"visibility_timeout_ms"}:
            raise InvalidArgument(
                f'queue "{name}" is a dead-letter queue: only its visibility_timeout_ms can '
                f'change (its messages are redriven through "{record.dlq_of}")'
            )
        updated = replace(record)
        for field, value in changes.items():
            if field == "visibility_timeout_ms":
                updated = replace(updated, visibility_timeout_ms=_visibility_timeout(int(value)))
            elif field == "max_attempts":
                updated = replace(updated, max_attempts=retry.stored_max_attempts(int(value)))
            elif field == "retry_backoff":
                backoff = str(retry.Backoff.parse(str(value)))
                updated = replace(updated, retry_backoff=backoff)
            elif field == "on_enqueue_script":
                updated = replace(updated, on_enqueue_script=str(value))
            else:
                updated = replace(updated, on_failure_script=str(value))
        hooks = queue.hooks
        if (updated.on_enqueue_script, updated.on_failure_script) != (
            record.on_enqueue_script,
            record.on_failure_script,
        ):
            hooks = self._make_hooks(updated)
        queue.record = updated
        queue.hooks = hooks
        self.state.committer.put(keys.queue_key(name), updated.encode(), name)
        log.info("queue updated", extra={"queue": name, "fields": ",".join(sorted(changes))})
        return updated, self.state.committer.flushed()

    def stats(self, name: str) -> QueueStats:
        """A queue's stats, at once: O(fairness keys) in this turn (see `stats_in_turns`)."""
        queue = self.state.queue(name)
        return self._stats(queue, _largest(queue.drr.keys.values()))

    async def stats_in_turns(self, name: str) -> QueueStats:
        """`stats` for GetStats: the fairness keys to list (the largest) are weighed
        `STATS_KEYS_PER_TURN` per loop turn, so a queue of a million keys does not hold
        the loop. A key that empties meanwhile is not listed."""
        queue = self.state.queue(name)
        keys = list(queue.drr.keys.values())
        largest: list[FairnessKey] = []
        for start in range(0, len(keys), STATS_KEYS_PER_TURN):
            if start:
                await asyncio.sleep(0)  # others are served between the slices
            largest = _largest(itertools.chain(largest, keys[start : start + STATS_KEYS_PER_TURN]))
        queue = self.state.queue(name)  # (deleted meanwhile: NOT_FOUND)
        return self._stats(queue, [key for key in largest if key])

    def _stats(self, queue: Queue, shown: Iterable[FairnessKey]) -> QueueStats:
        drr_keys = queue.drr.keys
        deliveries = queue.key_deliveries
        per_key = sorted(
            (
                KeyStats(k.name, len(k), k.deficit, k.weight, deliveries.get(k.name, 0))
                for k in shown
            ),
            key=lambda k: k.key,
        )
        hook_errors, last_error, last_error_at_ms = 0, "", 0
        if queue.hooks is not None:
            for counters in queue.hooks.counters().values():
                hook_errors += counters.failed
                if counters.last_error_at_ms >= last_error_at_ms and counters.failed:
                    last_error, last_error_at_ms = counters.last_error, counters.last_error_at_ms
        return QueueStats(
            depth=queue.depth,
            delayed=len(queue.delayed),
            hook_errors_total=hook_errors,
            last_hook_error=last_error,
            last_hook_error_at_ms=last_error_at_ms,
            in_flight=len(queue.leases),
            active_fairness_keys=len(drr_keys),
            active_consumers=len(queue.consumers),
            quantum=self.state.settings.quantum,
            per_key=per_key,
            per_throttle=self._throttle_stats(queue),
            counters=queue.counters,
        )

    def _throttle_stats(self, queue: Queue) -> list[ThrottleStats]:
        """The buckets this queue's ready messages use, else every bucket (capped)."""
        used: set[str] = set()
        for key in itertools.islice(queue.drr.keys.values(), MAX_LISTED_KEYS):
            if key:
                used.update(key.head_throttle_keys())
        stats = self.state.throttles.stats(used or None)
        return stats[:MAX_LISTED_KEYS]

    # -- runtime config ------------------------------------------------------------

    def set_config(self, key: str, value: str) -> asyncio.Future[None]:
        self.state.check_open()
        change = validate_entry(key, value)
        self.state.config.set(key, value)
        if value == "":
            self.state.committer.delete(keys.config_key(key))
        else:
            self.state.committer.put(keys.config_key(key), value.encode())
        if change is not None:
            self._apply_throttle(change)
        return self.state.committer.flushed()

    def get_config(self, key: str) -> str:
        value = self.state.config.get(key)
        if value is None:
            raise ConfigKeyNotFound(key)
        return value

    def list_config(self, prefix: str) -> tuple[list[tuple[str, str]], int]:
        """Entries under `prefix`, as many as fit in one answer, and how many there are."""
        entries = self.state.config.items(prefix)
        shown: list[tuple[str, str]] = []
        size = 0
        for key, value in entries:
            size += len(key) + len(value) + 8
            if size > MAX_ANSWER_BYTES:
                break
            shown.append((key, value))
        return shown, len(entries)

    def _apply_throttle(self, change: ThrottleChange) -> None:
        if change.rate is None or change.burst is None:
            self.state.throttles.remove(change.key)
        else:
            self.state.throttles.configure(change.key, change.rate, change.burst)
        for queue in self.state.queues.values():
            queue.throttle_wakes.clear()
            if queue.drr.unpark_all():
                self.state.mark_dirty(queue)

    # -- dead letters, peek, purge ---------------------------------------------------

    async def redrive(self, dlq_name: str, count: int) -> int:
        """Moves up to `count` (0 = all) ready DLQ messages back, re-running on_enqueue;
        returns how many moved, once their moves are committed.

        A DLQ can hold millions of messages, so they move in chunks, each bounded in
        messages, bytes and time (`REDRIVE_CHUNK_*`): a chunk is planned whole (records
        read, decisions made) before any of it moves, its moves are one write, and the
        next chunk starts once that write is committed. So the loop serves everyone
        else between chunks, and a crash at any point leaves each message in exactly one
        of the two queues. `count` is taken against the DLQ's ready messages at the
        start; each chunk takes what is ready then (a DLQ consumer may lease messages,
        a purge remove them, a DeleteQueue all of them meanwhile), and the redrive ends
        when nothing is left or the broker starts shutting down, answering what moved.
        A record that does not decode is set aside (`fila.core.quarantine`), not moved;
        a failure (a read error, a hook) leaves its chunk unmoved and fails the call."""
        state = self.state
        state.check_open()
        dlq = state.queue(dlq_name)
        source_name = dlq.record.dlq_of
        if not source_name:
            raise InvalidArgument(f'queue "{dlq_name}" is not a dead-letter queue')
        source = state.queue(source_name)
        ready = dlq.drr.ready_count
        wanted = min(count, ready) if count > 0 else ready  # any uint64 count is valid
        taken = moved = 0
        while taken < wanted:
            chunk_taken, chunk_moved = self._redrive_chunk(dlq, source, wanted - taken)
            if not chunk_taken:
                break  # nothing ready any more
            taken += chunk_taken
            moved += chunk_moved
            await state.committer.flushed()
            if not self._open():
                break
        return moved

    def _open(self) -> bool:
        try:
            self.state.check_open()
        except Unavailable:
            return False
        return True

    def _redrive_chunk(self, dlq: Queue, source: Queue, limit: int) -> tuple[int, int]:
        """Takes the next chunk (at most `limit`) of `dlq`'s ready messages and moves
        them to `source`, setting aside those that do not decode; returns (taken, moved).
        Nothing changes unless every message of the chunk could be planned."""
        state = self.state
        started = time.perf_counter()
        size = 0
        # (the message as it moves back, its new record), or (the message, its stored
        # record, why it does not decode) for one that is set aside instead
        planned: list[tuple[MessageRef, bytes, str | None]] = []
        for ref in itertools.islice(dlq.drr.upcoming(), min(limit, REDRIVE_CHUNK_MESSAGES)):
            record = state.read_record(ref.key)
            if record is None:
                raise InvalidArgument(f"dead-lettered message {ref.id} has no stored record")
            size += len(record)
            try:
                message = stored.decode_message(ref.key, record)
            except stored.BadRecord as exc:
                planned.append((ref, record, str(exc)))
                continue
            decision = state.decide_enqueue(source, message.headers, len(message.payload))
            metadata = message.metadata
            metadata.fairness_key = decision.fairness_key
            metadata.weight = decision.weight
            del metadata.throttle_keys[:]
            metadata.throttle_keys.extend(decision.throttle_keys)
            metadata.attempt_count = 0
            metadata.queue_id = source.name
            moved = MessageRef(
                ref.key, decision.fairness_key, decision.weight, decision.throttle_keys, 0
            )
            planned.append((moved, stored.rebuild_message(message), None))
            if size >= REDRIVE_CHUNK_BYTES or time.perf_counter() - started >= REDRIVE_CHUNK_S:
                break
        taken = dlq.drr.take(len(planned))
        assert [r.key for r in taken] == [m.key for m, _, _ in planned], "redrive order changed"
        committer = state.committer
        moved_refs: list[MessageRef] = []
        for moved, record, bad in planned:
            if bad is not None:
                state.quarantine.set_aside(committer, moved.key, record, bad)
                continue
            committer.put(moved.key, record, source.name)
            moved_refs.append(moved)
        state.ready_after_commit(source, moved_refs, fresh=True)
        source.counters.redriven += len(moved_refs)
        return len(planned), len(moved_refs)

    async def peek(
        self, queue_name: str, limit: int, after_id: str, fairness_key: str
    ) -> tuple[list[messages_pb2.Message], str]:
        """`peek_states` without the states: the page and the next `after_id`."""
        page, _, next_after = await self.peek_states(queue_name, limit, after_id, fairness_key)
        return page, next_after

    async def peek_states(
        self, queue_name: str, limit: int, after_id: str, fairness_key: str, state: int = 0
    ) -> tuple[list[messages_pb2.Message], list[PeekedState], str]:
        """Ready, delayed and leased messages in id order (only those in `state`, a
        `MessageState` number, when it is set), changing nothing.

        Returns the page, each message's state, and the id to pass as `after_id` for
        the next page (empty at the end).

        No turn of the loop does more than a bounded amount of work, whatever the size
        of the queue: delayed and leased messages page from their kept key order
        (`fila.core.key_order`), and the ready messages of a queue with many fairness
        keys are found over several turns (`_first_ready_keys`). A message that changes
        state while its page is put together may be missing from that page."""
        queue = self.state.queue(queue_name)
        if state not in (0, *MessageState):
            raise InvalidArgument(f"state {state} is not a message state (READY, DELAYED, LEASED)")
        limit = DEFAULT_PEEK if limit == 0 else min(limit, MAX_PEEK)
        after = b""
        if after_id:
            raw = parse_id(after_id)
            if raw is None:
                raise InvalidArgument(f'after_id "{clip(after_id)}" is not a message id')
            after = keys.MESSAGE + raw
        ready_keys: list[FairnessKey] = []
        if state in (0, MessageState.READY):
            ready_keys = await self._first_ready_keys(queue, after, fairness_key, limit + 1)
            if queue.deleted:
                raise QueueNotFound(queue.name)
        candidates = self._peek_candidates(queue, after, fairness_key, state, ready_keys)
        refs = list(itertools.islice(candidates, limit + 1))
        more = len(refs) > limit
        # A filtered scan that gave up: the page ends there, and the next starts after it.
        resume = next((ref.id for ref in refs if isinstance(ref, _ScanEnd)), "")
        if resume:
            refs = list(itertools.takewhile(lambda ref: not isinstance(ref, _ScanEnd), refs))
        page: list[messages_pb2.Message] = []
        states: list[PeekedState] = []
        size = 0
        for ref in refs[:limit]:
            record = self.state.read_record(ref.key)
            if record is None:
                continue
            if page and size + len(record) > MAX_ANSWER_BYTES:
                more = True
                resume = ""
                break
            size += len(record)
            try:
                message = stored.decode_message(ref.key, record)
            except stored.BadRecord as exc:
                # Peek changes nothing; the record is set aside when it is next
                # settled, redriven, or at the next start.
                log.error(
                    "peek skipped a stored record that does not decode",
                    extra={"queue": queue.name, "message_id": ref.id, "reason": str(exc)},
                )
                continue
            lease = queue.leases.get(ref.key)
            if lease is not None:
                message.timestamps.leased_at.FromMilliseconds(lease.leased_at_ms)
                states.append(PeekedState(MessageState.LEASED, 0, lease.deadline_ms))
            elif queue.delayed.get(ref.key) is ref:
                states.append(PeekedState(MessageState.DELAYED, self._due_ms(ref), 0))
            else:
                states.append(PeekedState(MessageState.READY, 0, 0))
            page.append(message)
        next_after = resume or (page[-1].id if more and page else "")
        return page, states, next_after

    def _due_ms(self, ref: MessageRef) -> int:
        """When a delayed message becomes ready, from its side record (0: not readable
        yet, or damaged: peek changes nothing and reports what it can)."""
        raw = self.state.read_record(keys.delay_key(ref.key))
        try:
            return stored.decode_due(raw) if raw is not None else 0
        except stored.BadRecord:
            return 0

    async def _first_ready_keys(
        self, queue: Queue, after: bytes, fairness_key: str, count: int
    ) -> list[FairnessKey]:
        """The fairness keys whose ready messages above `after` can be among the first
        `count`: those with the `count` smallest first messages above `after` (a message
        of any other key has at least `count` smaller ones before it), or `fairness_key`
        alone. A queue can have millions of keys, so they are looked at in slices of
        `PEEK_KEYS_PER_TURN`, one loop turn each."""
        drr_keys = queue.drr.keys
        if fairness_key:
            key = drr_keys.get(fairness_key)
            return [] if key is None else [key]
        keys = list(drr_keys.values())
        if len(keys) <= count:
            return keys
        best: list[tuple[bytes, int, FairnessKey]] = []
        for start in range(0, len(keys), PEEK_KEYS_PER_TURN):
            if start:
                await asyncio.sleep(0)
            firsts = [
                (first, index, key)
                for index, key in enumerate(keys[start : start + PEEK_KEYS_PER_TURN], start)
                if (first := key.first_above(after)) is not None
            ]
            best = heapq.nsmallest(count, [*best, *firsts])
        return [key for _, _, key in best if queue.drr.keys.get(key.name) is key]

    def _peek_candidates(
        self,
        queue: Queue,
        after: bytes,
        fairness_key: str,
        state: int,
        ready_keys: list[FairnessKey],
    ) -> Iterator[MessageRef]:
        """The visible messages of `queue` (in `state`, when set) with a key above
        `after`, in key (id) order: the ready ones of `ready_keys`, and the delayed and
        leased ones (of `fairness_key`, when set, with a `_ScanEnd` where a scan gave
        up after `PEEK_SCAN` others)."""
        sources: list[Iterable[MessageRef]] = [key.iter_from(after) for key in ready_keys]
        if state in (0, MessageState.DELAYED):
            sources.append(_of_key(queue.delayed.iter_from(after), fairness_key))
        if state in (0, MessageState.LEASED):
            leased = (lease.ref for lease in queue.leases.iter_from(after))
            sources.append(_of_key(leased, fairness_key))
        return heapq.merge(*sources, key=_ref_key)

    def purge(self, queue_name: str) -> tuple[int, asyncio.Future[None]]:
        """Deletes every ready and delayed message (leased ones finish normally): gone
        from memory at once, their records deleted a chunk per turn (`fila.core.removal`);
        the future is done when the last chunk is committed."""
        self.state.check_open()
        queue = self.state.queue(queue_name)
        count = queue.depth
        detached = _detach_messages(queue)
        queue.counters.purged += count
        log.info("queue purged", extra={"queue": queue.name, "messages": count})
        return count, self._in_background(
            removal.delete_records(self.state.committer, [detached], (), self._open, "purge")
        )

    # -- restore (recovery), and letting go -------------------------------------------

    def unload_queue(self, name: str, reason: BrokerError) -> None:
        """Stops serving `name` without touching its storage (cluster replication:
        another node leads it now, and this node keeps its records as a replica). Its
        consumers end with `reason`; its leases, delays and timers are dropped from
        memory, and nothing is written."""
        queue = self.state.queues.pop(name, None)
        if queue is None:
            return
        queue.deleted = True  # what still waits on it (timers, commits) lets it be
        self.state.unmark_dirty(queue)
        queue.consumers.close_all(reason)
        self._delivery.buffers_released()

    def restore_queue(self, record: QueueRecord) -> Queue:
        """A stored queue; a stored script that no longer loads is logged, not fatal."""
        try:
            hooks = self._make_hooks(record, strict=False)
        except InvalidArgument as exc:
            log.error(
                "stored script no longer loads, hooks disabled",
                extra={"queue": record.name, "error": str(exc)},
            )
            hooks = None
        return self._add_queue(record, hooks)

    def restore_config(self, key: str, value: str) -> None:
        self.state.config.set(key, value)
        try:
            change = validate_entry(key, value)
        except InvalidArgument as exc:
            log.error(
                "stored config is invalid, ignored for throttling",
                extra={"config_key": key, "error": str(exc)},
            )
            return
        if change is not None:
            self._apply_throttle(change)

    # -- internals -------------------------------------------------------------------

    def _add_queue(self, record: QueueRecord, hooks: QueueHooks | None) -> Queue:
        queue = Queue(
            record,
            hooks,
            self.state.settings.quantum,
            self.state.committer,
            self._settlement.schedule_expiry,
            self.state.mark_dirty,
        )
        self.state.queues[record.name] = queue
        return queue

    def _make_hooks(self, record: QueueRecord, *, strict: bool = True) -> QueueHooks | None:
        """The queue's hooks; `strict` (creation, update) also refuses calls of what the
        sandbox lacks, which recovery does not (a stored queue loads as it did)."""
        if not (record.on_enqueue_script.strip() or record.on_failure_script.strip()):
            return None
        try:
            return QueueHooks(
                record.name,
                record.on_enqueue_script,
                record.on_failure_script,
                self.state.settings.lua,
                self.state.config.get,
                self.state.clock,
                strict=strict,
            )
        except ScriptError as exc:
            raise InvalidArgument(f'queue "{record.name}": {exc}') from None

    def _drop_queue(self, queue: Queue) -> removal.Detached:
        """Takes `queue` out of the broker: its consumers end, its leases end with their
        messages; its ready and delayed messages are returned for `fila.core.removal`."""
        queue.deleted = True
        del self.state.queues[queue.name]
        self.state.unmark_dirty(queue)
        queue.consumers.close_all(QueueNotFound(queue.name))
        self._delivery.buffers_released()  # its streams' buffers count no more
        self._settlement.queue_deleted(queue)
        return _detach_messages(queue)

    def _in_background(
        self, work: Coroutine[None, None, None], then: Callable[[], None] | None = None
    ) -> asyncio.Future[None]:
        """Runs `work` as a task the caller's cancellation cannot stop half-way (a
        client that hangs up does not leave a purge or a deletion part-done), and
        `then` once it has ended, however it ended."""
        task = asyncio.ensure_future(work)
        self._background.add(task)

        def ended(task: asyncio.Task[None]) -> None:
            self._background.discard(task)
            if then is not None:
                then()

        task.add_done_callback(ended)
        return asyncio.shield(task)


def _detach_messages(queue: Queue) -> removal.Detached:
    """`queue`'s ready and delayed messages, and those whose write is committing, out
    of memory at once (see `fila.core.removal`); their records are still stored."""
    committing = list(queue.limbo.values())
    queue.limbo.clear()  # cleared in place: their after-commit callbacks hold this dict
    return removal.Detached(queue.name, queue.drr.detach(), queue.detach_delayed(), committing)


def _largest(keys: Iterable[FairnessKey]) -> list[FairnessKey]:
    """The `MAX_LISTED_KEYS` keys holding the most ready messages (all, if fewer)."""
    return heapq.nlargest(MAX_LISTED_KEYS, keys, key=len)
