"""The core's state and its shared primitives, owned by the event loop.

Every queue, message, lease, consumer and throttle lives here, created, read and
changed only on the loop, so there are no locks. The parts that act on it take this
object and nothing above them: `Settlement` (how a lease ends), `Delivery` (consumers
and the pump), `Administration` (queues, config, stats, redrive, peek, purge),
`Enqueueing` and recovery; `fila.core.broker.Broker` is the facade the edge calls.
What the parts share is here, in one place each:

- the queue lookup and the closed check;
- *ready only after commit* (`ready_after_commit`): a message becomes deliverable only
  once the write that produced its current record is committed, so a consumer never
  sees a message the broker could forget, and delivery can always read it back;
- delays (`delay`, `release_delayed`), stored and released on the clock;
- record reads (`read_record`), where a storage failure stops the broker, and a
  delivery's (`take_record`), which takes the record the committer kept since its
  write where it did, instead of reading it back;
- the enqueue decision (`decide_enqueue`: the `on_enqueue` hook, throttle keys shared);
- the dirty set: queues to pump at the end of this loop turn. The pump itself is
  `Delivery.pump`, handed in once by the facade (`pump`): the one call from here up.
"""

from __future__ import annotations

import asyncio
import logging
import random as _random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fila.clock import Clock
from fila.config import Config
from fila.core.consumers import BufferBudget
from fila.core.enqueueing import Limits
from fila.core.errors import QueueNotFound, Unavailable
from fila.core.ids import IdGenerator
from fila.core.quarantine import Quarantine
from fila.core.queue import Queue, validate_queue_name
from fila.core.records import MessageRef
from fila.core.retry import Random
from fila.core.runtime_config import RuntimeConfig
from fila.core.throttle import Throttles
from fila.core.timers import Timers
from fila.lua.hooks import DEFAULT_ENQUEUE, EnqueueDecision, LuaLimits
from fila.storage import keys
from fila.storage.backend import Storage, StorageError
from fila.storage.committer import Committer

log = logging.getLogger("fila.broker")

MAX_DELAY_MS = 366 * 24 * 3600 * 1000
_MAX_SHARED_THROTTLE_TUPLES = 100_000


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    quantum: int
    consumer_buffer: int
    max_prefetch: int
    max_batch_messages: int
    keepalive_s: float
    limits: Limits
    max_queue_depth: int
    max_queues: int
    stream_buffer_bytes: int
    total_buffer_bytes: int
    lua: LuaLimits

    @classmethod
    def from_config(cls, config: Config) -> BrokerSettings:
        server, scheduler = config.server, config.scheduler
        return cls(
            quantum=scheduler.quantum,
            consumer_buffer=scheduler.consumer_buffer,
            max_prefetch=scheduler.max_prefetch,
            max_batch_messages=server.max_batch_messages,
            keepalive_s=scheduler.keepalive_ms / 1000,
            limits=Limits(
                max_message_bytes=server.max_message_bytes,
                max_headers=server.max_headers,
                max_header_bytes=server.max_header_bytes,
                max_delay_ms=MAX_DELAY_MS,
            ),
            max_queue_depth=server.max_queue_depth,
            max_queues=server.max_queues,
            stream_buffer_bytes=scheduler.stream_buffer_bytes,
            total_buffer_bytes=scheduler.total_buffer_bytes,
            lua=LuaLimits(
                timeout_ms=config.lua.default_timeout_ms,
                memory_limit_bytes=config.lua.default_memory_limit_bytes,
                breaker_threshold=config.lua.circuit_breaker_threshold,
                breaker_cooldown_ms=config.lua.circuit_breaker_cooldown_ms,
            ),
        )


def _no_pump(queue: Queue) -> None:
    raise RuntimeError("CoreState.pump was not set (the facade hands in Delivery.pump)")


class CoreState:
    def __init__(
        self,
        storage: Storage,
        committer: Committer,
        settings: BrokerSettings,
        clock: Clock,
        *,
        loop_driven_timers: bool = True,
        on_storage_failure: Callable[[StorageError], None] | None = None,
        random: Random = _random.random,
    ) -> None:
        """`random`: the draw for retry backoff jitter (tests pin it)."""
        self.storage = storage
        self.committer = committer
        self.settings = settings
        self.clock = clock
        self.random = random
        self.queues: dict[str, Queue] = {}
        self.config = RuntimeConfig()
        self.throttles = Throttles(clock)
        self.timers = Timers(clock, _timer_subject_is_live, loop_driven=loop_driven_timers)
        self.ids = IdGenerator(clock)
        self.buffers = BufferBudget(settings.total_buffer_bytes)
        self.quarantine = Quarantine()
        self.pump: Callable[[Queue], None] = _no_pump
        self.closing = False
        self._throttle_tuples: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._dirty: set[Queue] = set()
        self._pump_scheduled = False
        self._on_storage_failure = on_storage_failure

    def queue(self, name: str) -> Queue:
        """The live queue `name`; NOT_FOUND (or INVALID_ARGUMENT for a bad name) otherwise."""
        queue = self.queues.get(name)
        if queue is None:
            validate_queue_name(name)
            raise QueueNotFound(name)
        return queue

    def check_open(self) -> None:
        if self.closing:
            raise Unavailable("broker is shutting down")

    # -- the dirty set ---------------------------------------------------------------

    def mark_dirty(self, queue: Queue) -> None:
        """Schedules a pump of `queue` at the end of this turn of the event loop."""
        self._dirty.add(queue)
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump_dirty)

    def unmark_dirty(self, queue: Queue) -> None:
        self._dirty.discard(queue)

    def mark_all_dirty(self) -> None:
        for queue in self.queues.values():
            self.mark_dirty(queue)

    def _pump_dirty(self) -> None:
        self._pump_scheduled = False
        dirty, self._dirty = self._dirty, set()
        pump = self.pump
        for queue in dirty:
            if not queue.deleted:
                pump(queue)

    # -- ready after commit, delays ----------------------------------------------------

    def ready_after_commit(self, queue: Queue, refs: Sequence[MessageRef], *, fresh: bool) -> None:
        """Makes `refs` deliverable once the write that produced their records is
        committed: the rule that keeps a consumer from seeing a message the broker
        could still lose. Until then they count in the queue's depth (`limbo`)."""
        limbo = queue.limbo
        for ref in refs:
            limbo[ref.key] = ref

        def settle() -> None:
            if queue.deleted:
                return
            push = queue.drr.push
            pushed = False
            for ref in refs:
                if limbo.pop(ref.key, None) is not None:  # else purged meanwhile
                    push(ref, fresh=fresh)
                    pushed = True
            if pushed:
                self.mark_dirty(queue)

        self.committer.after_commit(settle)

    def delay(self, queue: Queue, ref: MessageRef, due_ms: int) -> None:
        """Stores `ref` as delayed until `due_ms`; it becomes ready then (durably)."""
        queue.delayed[ref.key] = ref
        self.committer.put(keys.delay_key(ref.key), keys.encode_due(due_ms), queue.name)
        self.committer.after_commit(lambda: self.schedule_release(queue, ref, due_ms))

    def schedule_release(self, queue: Queue, ref: MessageRef, due_ms: int) -> None:
        """Arms the timer that makes a delayed message ready at `due_ms` (also recovery's)."""
        self.timers.at(due_ms, self.release_delayed, (queue, ref))

    def release_delayed(self, subject: tuple[Queue, MessageRef]) -> None:
        """Timer callback: a delayed message is due and becomes ready."""
        queue, ref = subject
        if queue.deleted or queue.delayed.get(ref.key) is not ref:
            return  # purged, deleted or already moved
        del queue.delayed[ref.key]
        self.committer.delete(keys.delay_key(ref.key), queue.name)
        queue.drr.push(ref, fresh=False)
        self.mark_dirty(queue)

    # -- records and decisions ---------------------------------------------------------

    def take_record(self, key: bytes) -> bytes | None:
        """A message's record for its delivery: kept since its write if the committer
        kept it (`fila.storage.recent`, given up now), else read from storage."""
        record = self.committer.recent.take(key)
        return record if record is not None else self.read_record(key)

    def read_record(self, key: bytes) -> bytes | None:
        """A stored record; a read that fails its checksum stops the broker."""
        try:
            return self.storage.get(key)
        except StorageError as exc:
            log.critical("storage failure, stopping", extra={"error": str(exc)})
            if self._on_storage_failure is not None:
                self._on_storage_failure(exc)
            raise Unavailable(f"{exc}; the broker is stopping") from None

    def decide_enqueue(self, queue: Queue, headers: object, payload_size: int) -> EnqueueDecision:
        """`on_enqueue`'s decision for a message (enqueue and redrive), keys shared."""
        hooks = queue.hooks
        if hooks is None or not hooks.has_on_enqueue:
            return DEFAULT_ENQUEUE
        decision = hooks.on_enqueue(headers, payload_size)  # type: ignore[arg-type]
        throttle_keys = decision.throttle_keys
        if throttle_keys:
            shared = self._throttle_tuples.get(throttle_keys)
            if shared is None:
                if len(self._throttle_tuples) > _MAX_SHARED_THROTTLE_TUPLES:
                    self._throttle_tuples.clear()
                shared = self._throttle_tuples[throttle_keys] = throttle_keys
            if shared is not throttle_keys:
                decision = EnqueueDecision(decision.fairness_key, decision.weight, shared)
        return decision


def _timer_subject_is_live(subject: object) -> bool:
    """Whether a timer entry can still matter (see `Timers`): an expiry whose leases
    all ended and a delayed message that moved are dead; throttle wake-ups are cheap
    and kept."""
    if isinstance(subject, tuple):
        queue, item = subject
        if queue.deleted:
            return False
        if isinstance(item, int):
            return bool(queue.leases.has_due(item))
        return bool(queue.delayed.get(item.key) is item)
    return True
