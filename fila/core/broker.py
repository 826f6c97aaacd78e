r"""The single owner of broker state.

Every queue, DRR ring, lease, delayed retry, throttle bucket and Lua state is
created, read and changed only here, on the event loop, so there are no locks
and every invariant lives in one place. The gRPC edge calls these methods
directly; a method validates everything before it changes anything (a bad
request leaves no trace), applies the change in memory, hands the matching
writes to the committer, and returns the future the caller awaits before
answering.

Message life cycle, and the one rule that keeps memory and disk in step: a
message becomes *ready* (deliverable) only after the write that produced its
current record is committed. So a consumer never sees a message the broker
could forget, and delivery can always read the record back from RocksDB.

    enqueue -> (commit) -> ready -> leased -> ack: deleted
                                          \-> nack / lease expiry -> ready | delayed | DLQ
"""

from __future__ import annotations

from fila.core.administration import Administration
from fila.core.delivery import Delivery
from fila.core.enqueueing import Enqueueing, EnqueueItem
from fila.core.errors import Unavailable
from fila.core.queue import Queue
from fila.core.records import Lease, MessageRef
from fila.core.settlement import Settlement
from fila.core.state import BrokerSettings

__all__ = ["Broker", "BrokerSettings", "EnqueueItem"]


class Broker(Administration, Enqueueing, Delivery, Settlement):
    """The single owner; its methods are grouped by concern in the mixin modules."""

    def schedule_expiry(self, queue: Queue, lease: Lease) -> None:
        self.timers.at(lease.deadline_ms, self._expire, (queue, lease))

    def schedule_due(self, queue: Queue, ref: MessageRef, due_ms: int) -> None:
        queue.delayed[ref.id] = ref
        self.timers.at(due_ms, self._due, (queue, ref))

    def close(self) -> None:
        """Stops accepting work, returns unsent deliveries and commits what is pending."""
        self._closing = True
        for queue in list(self.queues.values()):
            for consumer in list(queue.consumers.values()):
                self.detach_consumer(consumer, Unavailable("broker is shutting down"))
        self.committer.flush_now()
        self.timers.close()
