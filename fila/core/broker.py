r"""The broker: the facade the gRPC edge (and the cluster, telemetry, tests) calls.

Everything is created, read and changed on the event loop, so there are no locks.
The edge decodes a request, calls one method here, and encodes the answer. This
class only wires the parts and hands out their methods; each invariant has one
owner among them, and they read in one direction (nothing calls back up):

    Broker (facade) -> Administration -> Delivery -> Settlement -> CoreState
                    -> Enqueueing ----------------------------------^
    recovery (startup) -> Administration, CoreState

- `CoreState` (`state.py`): queues, config, throttles, timers, the dirty set, *ready
  only after commit*, delays, record reads, the enqueue decision;
- `Settlement` (`settlement.py`): how a lease ends (ack, nack, extend, expiry, stream
  end, queue deleted), with `LeaseTable` keeping the record;
- `Delivery` (`delivery.py`): consumers and the pump that leases messages to them;
- `Administration` (`administration.py`): queues, config, stats, redrive, peek, purge;
- `Enqueueing` (`enqueue.py`): the one enqueue path, a batch of one included.

A method validates before it changes anything (a bad request or a bad batch item
leaves no trace), applies the change in memory, hands the matching writes to the
committer, and returns the future the caller awaits before answering.

Message life cycle:

    enqueue -> (commit) -> ready -> leased -> ack: deleted
          \-> delayed -/        \-> nack / expiry -> ready | delayed | DLQ
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable, Collection

from fila.clock import Clock
from fila.core.administration import Administration
from fila.core.delivery import Delivery
from fila.core.enqueue import Enqueueing, ItemResult
from fila.core.errors import Unavailable
from fila.core.recovery import RecoveryReport, recover, recover_queues
from fila.core.retry import Random
from fila.core.settlement import Settlement
from fila.core.state import BrokerSettings, CoreState
from fila.storage.backend import Storage, StorageError
from fila.storage.committer import Committer

__all__ = ["Broker", "BrokerSettings", "ItemResult"]


class Broker:
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
        """`loop_driven_timers` False: the caller runs `timers.run_due()` after moving
        the clock (in-process tests on a manual clock). `random`: the draw for retry
        backoff jitter (tests pin it)."""
        state = CoreState(
            storage,
            committer,
            settings,
            clock,
            loop_driven_timers=loop_driven_timers,
            on_storage_failure=on_storage_failure,
            random=random,
        )
        settlement = Settlement(state)
        delivery = Delivery(state, settlement)
        admin = Administration(state, delivery, settlement)
        enqueueing = Enqueueing(state)
        state.pump = delivery.pump
        self._state = state
        self._admin = admin
        self._delivery = delivery

        # What the rest of the broker reads (telemetry, the edge's limits, tests).
        self.settings = settings
        self.clock = clock
        self.storage = storage
        self.committer = committer
        self.queues = state.queues
        self.config = state.config
        self.throttles = state.throttles
        self.timers = state.timers
        self.quarantine = state.quarantine
        self.buffers = state.buffers

        # Messages in.
        self.enqueue = enqueueing.enqueue
        # Leases out and how they end.
        self.attach_consumer = delivery.attach_consumer
        self.detach_consumer = delivery.detach_consumer
        self.sending = delivery.sending
        self.sent = delivery.sent
        self.end_consumers = delivery.end_consumers
        self.ack = settlement.ack
        self.nack = settlement.nack
        self.extend_lease = settlement.extend_lease
        self.settle_on_stream = settlement.settle_on_stream
        # Queues, config, stats, dead letters.
        self.create_queue = admin.create_queue
        self.check_create = admin.check_create
        self.delete_queue = admin.delete_queue
        self.list_queues = admin.list_queues
        self.get_queue = admin.get_queue
        self.update_queue = admin.update_queue
        self.stats = admin.stats
        self.stats_in_turns = admin.stats_in_turns
        self.set_config = admin.set_config
        # Config that arrives already decided (cluster mode: mirrored from etcd): an
        # invalid throttle value is logged and ignored, as at recovery.
        self.apply_config = admin.restore_config
        self.get_config = admin.get_config
        self.list_config = admin.list_config
        self.redrive = admin.redrive
        self.peek = admin.peek
        self.peek_states = admin.peek_states
        self.purge = admin.purge
        # Cluster replication: a queue another node leads now is let go of, its
        # storage kept (consumers end with the reason given).
        self.unload_queue = admin.unload_queue

    def recover(self, held: Callable[[str], bool] | None = None) -> RecoveryReport:
        """Rebuilds the state from storage (at startup, before serving), but the
        queues `held` names (a cluster node's replicas, see `recover_queues`)."""
        return recover(self._state, self._admin, held=held)

    def recover_queues(self, names: Collection[str]) -> RecoveryReport:
        """Rebuilds queues `names` from storage while serving (a cluster node that
        has just taken the lead of a replicated queue)."""
        return recover_queues(self._state, self._admin, names)

    def close(self) -> None:
        """Stops accepting work, returns unsent deliveries and commits what is pending."""
        self._state.closing = True
        self._delivery.end_consumers(Unavailable("broker is shutting down"))
        self.committer.flush_now()
        self.timers.close()
