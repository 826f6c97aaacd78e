"""The broker's state and the primitives shared by its concerns.

`Broker` is one object, but its methods live in sibling modules by concern
(`enqueueing`, `delivery`, `settlement`, `administration`), each a mixin over
this base. A reader looking for "what happens on nack" opens one file; all of
them mutate the same state, on the event loop only.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass

from rocksdict import Rdict

from fila.config import Config
from fila.core.clock import Clock
from fila.core.errors import (
    QueueNotFound,
    Unavailable,
)
from fila.core.ids import IdGenerator
from fila.core.queue import Queue, validate_queue_name
from fila.core.records import Lease, MessageRef
from fila.core.runtime_config import RuntimeConfig
from fila.core.stats import BrokerCounters
from fila.core.throttle import Throttles
from fila.core.timers import Timers
from fila.lua.hooks import LuaLimits
from fila.storage.store import Committer


@dataclass(frozen=True, slots=True)
class BrokerSettings:
    quantum: int
    consumer_buffer: int
    keepalive_s: float
    max_message_bytes: int
    max_headers: int
    max_header_bytes: int
    max_queue_depth: int
    lua: LuaLimits

    @classmethod
    def from_config(cls, config: Config) -> BrokerSettings:
        return cls(
            quantum=config.scheduler.quantum,
            consumer_buffer=config.scheduler.consumer_buffer,
            keepalive_s=config.scheduler.keepalive_ms / 1000,
            max_message_bytes=config.server.max_message_bytes,
            max_headers=config.server.max_headers,
            max_header_bytes=config.server.max_header_bytes,
            max_queue_depth=config.server.max_queue_depth,
            lua=LuaLimits(
                timeout_ms=config.lua.default_timeout_ms,
                memory_limit_bytes=config.lua.default_memory_limit_bytes,
                breaker_threshold=config.lua.circuit_breaker_threshold,
                breaker_cooldown_ms=config.lua.circuit_breaker_cooldown_ms,
            ),
        )


class BrokerState(ABC):
    """Everything the broker owns, and the primitives all of its concerns share."""

    def __init__(
        self, db: Rdict, committer: Committer, settings: BrokerSettings, clock: Clock
    ) -> None:
        self.db = db
        self.committer = committer
        self.settings = settings
        self.clock = clock
        self.queues: dict[str, Queue] = {}
        self.config = RuntimeConfig()
        self.throttles = Throttles(clock)
        self.timers = Timers(clock, _timer_subject_is_live)
        self.counters = BrokerCounters()
        self.ids = IdGenerator(clock)
        self._dirty: set[Queue] = set()
        self._pump_scheduled = False
        self._closing = False

    def _queue(self, name: str) -> Queue:
        queue = self.queues.get(name)
        if queue is None:
            validate_queue_name(name)
            raise QueueNotFound(name)
        return queue

    def _check_open(self) -> None:
        if self._closing:
            raise Unavailable("broker is shutting down")

    def _mark_dirty(self, queue: Queue) -> None:
        self._dirty.add(queue)
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump_dirty)

    def _pump_dirty(self) -> None:
        self._pump_scheduled = False
        dirty, self._dirty = self._dirty, set()
        for queue in dirty:
            if not queue.deleted:
                self._pump(queue)

    def _end_lease(self, queue: Queue, lease: Lease) -> None:
        """Every way a lease ends comes here, so its consumer gets the slot back."""
        lease.active = False
        consumer = lease.consumer
        if consumer is None:
            return
        consumer.unsettled -= 1
        if not consumer.waiting and consumer.has_room and consumer.id in queue.consumers:
            queue.waiting.append(consumer)
            consumer.waiting = True
            self._mark_dirty(queue)

    def _return_unsent(self, queue: Queue, lease: Lease) -> None:
        """A leased message never reached its consumer: back to ready, no attempt counted."""
        self._end_lease(queue, lease)
        queue.leases.pop(lease.ref.id, None)
        queue.drr.push(lease.ref, fresh=False)
        self._mark_dirty(queue)

    def _ready_after_commit(self, queue: Queue, refs: list[MessageRef], *, fresh: bool) -> None:
        """Makes `refs` deliverable once the write that produced their records is
        committed: the rule that keeps a consumer from seeing a message the broker
        could still lose. Until then they count in the queue's depth."""
        queue.in_limbo += len(refs)

        def settle() -> None:
            queue.in_limbo -= len(refs)
            if queue.deleted:
                for ref in refs:
                    self.committer.delete(ref.key)
                return
            push = queue.drr.push
            for ref in refs:
                push(ref, fresh=fresh)
            self._mark_dirty(queue)

        self.committer.after_commit(settle)

    def mark_all_dirty(self) -> None:
        for queue in self.queues.values():
            self._mark_dirty(queue)

    @abstractmethod
    def _pump(self, queue: Queue) -> None:
        """Delivers what `queue` can deliver now (see `Delivery`)."""

    @abstractmethod
    def _expire(self, subject: tuple[Queue, Lease]) -> None:
        """Ends a lease whose visibility timeout passed (see `Settlement`)."""


def _timer_subject_is_live(subject: object) -> bool:
    """Whether a timer entry can still matter (see `Timers`): leases and delayed
    retries that ended are dead; throttle wake-ups are cheap and always kept."""
    if isinstance(subject, tuple):
        queue, item = subject
        if isinstance(item, Lease):
            return item.active
        return not queue.deleted and queue.delayed.get(item.id) is item
    return True
