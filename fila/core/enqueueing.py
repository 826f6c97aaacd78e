"""Enqueue: validate a batch, run `on_enqueue`, store, and make ready once committed.

A single enqueue is a batch of one; every item is checked before any is written,
so a bad item refuses the whole batch and changes nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fila.core.errors import InvalidArgument, ResourceExhausted
from fila.core.frames import timestamp
from fila.core.records import MessageRef
from fila.core.state import BrokerState
from fila.lua.hooks import DEFAULT_ENQUEUE
from fila.storage import keys
from fila.v1 import messages_pb2


@dataclass(frozen=True, slots=True)
class EnqueueItem:
    headers: Mapping[str, str]
    payload: bytes


class Enqueueing(BrokerState):
    """Storing new messages."""

    def enqueue(
        self, queue_name: str, items: Sequence[EnqueueItem]
    ) -> tuple[list[str], asyncio.Future[None]]:
        """Stores a batch of messages; all are checked before any is written."""
        self._check_open()
        queue = self._queue(queue_name)
        for item in items:
            self._check_limits(item)
        limit = self.settings.max_queue_depth
        if limit and queue.depth + len(items) > limit:
            raise ResourceExhausted(
                f'queue "{queue.name}" is full: {queue.depth} messages, the limit is {limit}'
            )
        hooks = queue.hooks
        now_ms = self.clock.now_ms()
        enqueued_at = timestamp(now_ms)
        committer = self.committer
        ids: list[str] = []
        refs: list[MessageRef] = []
        for item in items:
            decision = (
                hooks.on_enqueue(item.headers, len(item.payload))
                if hooks is not None
                else DEFAULT_ENQUEUE
            )
            raw_id, message_id = self.ids.next()
            key = keys.MESSAGE + raw_id
            message = messages_pb2.Message(
                id=message_id,
                headers=item.headers,
                payload=item.payload,
                metadata=messages_pb2.MessageMetadata(
                    fairness_key=decision.fairness_key,
                    weight=decision.weight,
                    throttle_keys=decision.throttle_keys,
                    queue_id=queue.name,
                ),
                timestamps=messages_pb2.MessageTimestamps(enqueued_at=enqueued_at),
            )
            committer.put(key, message.SerializeToString())
            ids.append(message_id)
            refs.append(
                MessageRef(
                    key,
                    message_id,
                    decision.fairness_key,
                    decision.weight,
                    decision.throttle_keys,
                    0,
                )
            )
        self._ready_after_commit(queue, refs, fresh=True)
        self.counters.enqueued += len(refs)
        return ids, committer.flushed()

    def _check_limits(self, item: EnqueueItem) -> None:
        settings = self.settings
        if len(item.payload) > settings.max_message_bytes:
            raise InvalidArgument(
                f"payload is {len(item.payload)} bytes, the limit is {settings.max_message_bytes}"
            )
        headers = item.headers
        if not headers:
            return
        if len(headers) > settings.max_headers:
            raise InvalidArgument(
                f"message has {len(headers)} headers, the limit is {settings.max_headers}"
            )
        size = sum(len(k.encode()) + len(v.encode()) for k, v in headers.items())
        if size > settings.max_header_bytes:
            raise InvalidArgument(
                f"headers total {size} bytes, the limit is {settings.max_header_bytes}"
            )
