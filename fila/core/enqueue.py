"""Enqueue: a batch of requests checked, hooked and stored, each item on its own.

The one path for every way a message arrives (unary, batch, stream): a single
message is a batch of one. An item that fails gets its error in the results and
stores nothing; the others are stored, and become ready once their write is
committed (`CoreState.ready_after_commit`), or delayed (`delay_ms`). What is stored
is built by `fila.core.enqueueing.RecordEncoder` from the parsed, checked fields.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from fila.core.enqueueing import RecordEncoder, check_limits
from fila.core.errors import BrokerError, ResourceExhausted
from fila.core.queue import Queue
from fila.core.records import MessageRef
from fila.core.state import CoreState
from fila.storage import keys
from fila.v1 import service_pb2

# What a batch item ended as: its message id, or the error the single RPC would raise.
ItemResult = str | BrokerError


class Enqueueing:
    def __init__(self, state: CoreState) -> None:
        self.state = state
        self._encoder = RecordEncoder()

    def enqueue(
        self, requests: Sequence[service_pb2.EnqueueRequest]
    ) -> tuple[list[ItemResult], asyncio.Future[None]]:
        """Stores a batch; the future resolves when every stored item is committed.
        Note: the requests are consumed (their records are built from them)."""
        state = self.state
        state.check_open()
        limits = state.settings.limits
        max_depth = state.settings.max_queue_depth
        now_ms = state.clock.now_ms()
        committer = state.committer
        encode = self._encoder.encode
        next_id = state.ids.next
        results: list[ItemResult] = []
        ready: dict[Queue, list[MessageRef]] = {}
        for request in requests:
            try:
                queue = state.queue(request.queue)
                check_limits(request, limits)
                if max_depth:
                    depth = queue.depth + len(ready.get(queue, ()))
                    if depth >= max_depth:
                        raise ResourceExhausted(
                            f'queue "{queue.name}" is full: {depth} messages, '
                            f"the limit is {max_depth}"
                        )
                decision = state.decide_enqueue(queue, request.headers, len(request.payload))
            except BrokerError as exc:
                # Without its traceback: that holds this frame, and with it every
                # request and result of the batch, until the cycle collector runs.
                results.append(exc.with_traceback(None))
                continue
            delay_ms = request.delay_ms
            raw_id, message_id = next_id()
            key = keys.MESSAGE + raw_id
            record = encode(request, message_id, decision, queue.name, now_ms)
            committer.put(key, record, queue.name)
            ref = MessageRef(key, decision.fairness_key, decision.weight, decision.throttle_keys, 0)
            if delay_ms:
                state.delay(queue, ref, now_ms + delay_ms)
            else:
                ready.setdefault(queue, []).append(ref)
            queue.counters.enqueued += 1
            results.append(message_id)
        for queue, refs in ready.items():
            state.ready_after_commit(queue, refs, fresh=True)
        return results, committer.flushed()
