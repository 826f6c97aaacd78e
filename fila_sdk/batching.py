"""Many small calls as few RPCs: chunking for `*_many`, coalescing for concurrent calls.

A gRPC call costs each side far more CPU in Python than an item it carries adds
(docs/benchmarks.md, "Measurements behind design choices"), so the SDK carries many
items per call wherever the caller gives it the chance:

- `chunks` splits an explicit batch (`enqueue_many`) into requests that respect
  the broker's per-request limits: `server.max_batch_messages` (10,000 by default)
  and the transport's request size (`server.max_request_bytes`, 16 MiB).
- `Coalescer` gathers the single calls that an event loop makes in one turn
  (`AsyncClient.ack` from many tasks) into one batch RPC. It flushes from a
  `loop.call_soon` callback, that is as soon as the loop has run what was ready
  when the first call arrived, or at once when the batch is full. There is no
  timer: a lone caller is sent on the next turn of the loop, well under a
  millisecond, and under load the batches grow by themselves.

Each caller still gets its own result or its own exception: a batch RPC answers
per item, and a batch that fails as a whole fails each of its callers with that
error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Final, Generic, TypeVar

from fila.v1 import service_pb2

from ._channel import map_batch_error, milliseconds
from .arguments import checked_headers, payload_bytes
from .errors import ArgumentError, ClientClosedError, FilaError
from .types import EnqueueItem

Item = TypeVar("Item")
Result = TypeVar("Result")

# Below the broker's defaults (10,000 messages, 16 MiB) with room for framing, and
# small enough that a few requests can be in flight to overlap the broker's work
# on one with the group commit of another.
MAX_BATCH_MESSAGES: Final = 10_000
MAX_BATCH_BYTES: Final = 4 * 1024 * 1024
# How many chunks of one `enqueue_many` are in flight at once.
PIPELINE_DEPTH: Final = 4
# Per-message bytes a request spends beyond payload and headers (field tags,
# lengths, queue name allowance); only used to stay under the byte budget.
MESSAGE_OVERHEAD_BYTES: Final = 64
# Most UTF-8 bytes of error text a nack carries: a batch of 10,000 nacks then stays
# well under the broker's 16 MiB request limit.
MAX_ERROR_BYTES: Final = 1024
TRUNCATED_MARK: Final = " ...[truncated]"


# What one item of `enqueue_many` becomes: headers, payload, delay in ms.
Entry = tuple[Mapping[str, str] | None, bytes, int]
# One item of `enqueue_many`.
EnqueueLike = (
    EnqueueItem
    | bytes
    | str
    | tuple[Mapping[str, str] | None, bytes | str]
    | tuple[Mapping[str, str] | None, bytes | str, timedelta | float | None]
)
# One item of `nack_many`: a message id, or (message id, error text).
NackItem = str | tuple[str, str]


def entries(items: Iterable[EnqueueLike]) -> list[Entry]:
    """`enqueue_many`'s items as (headers, payload, delay_ms). An item is an
    `EnqueueItem`, bare payload bytes, or a (headers, payload[, delay]) tuple: the
    arguments `enqueue` takes.

    Every item is checked here, before anything is sent: an item the request could
    not carry, found after earlier chunks were stored, would raise with those
    messages stored and their ids lost (and a retry would store them twice)."""
    out: list[Entry] = []
    append = out.append
    for index, item in enumerate(items):
        if isinstance(item, bytes):
            append((None, item, 0))
            continue
        if isinstance(item, str):
            append((None, payload_bytes(item), 0))
            continue
        if isinstance(item, EnqueueItem):
            headers, payload, delay = item.headers, item.payload, item.delay
        elif isinstance(item, tuple) and len(item) in (2, 3):
            headers, payload = item[0], item[1]
            delay = item[2] if len(item) == 3 else None
        else:
            raise ArgumentError(
                "enqueue_many takes EnqueueItem, bytes, str or (headers, payload[, delay]) items, "
                f"not {type(item).__name__} (item {index})"
            )
        try:
            payload = payload_bytes(payload, f" of item {index}")
            headers = checked_headers(headers, f" of item {index}")
        except ArgumentError as err:
            raise ArgumentError(f"enqueue_many: {err}") from None
        append((headers, payload, 0 if delay is None else milliseconds(delay, "delay")))
    return out


def bounded_error(text: str) -> str:
    """A nack's error text, cut to `MAX_ERROR_BYTES` and marked if it was longer.

    The text is often an exception's message, which can hold a whole response body;
    a request over the broker's size limit fails as a whole, with every settlement
    it carries (and ends a `Worker`). Every nack the SDK sends passes here."""
    if len(text) <= MAX_ERROR_BYTES // 4:  # a character is at most 4 bytes
        return text
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= MAX_ERROR_BYTES:
        return text
    keep = data[: MAX_ERROR_BYTES - len(TRUNCATED_MARK)].decode("utf-8", "ignore")
    return keep + TRUNCATED_MARK


def entry_bytes(entry: Entry) -> int:
    headers, payload, _ = entry
    size = len(payload) + MESSAGE_OVERHEAD_BYTES
    if headers:
        size += sum(map(len, headers)) + sum(map(len, headers.values()))
    return size


def enqueue_batch_request(
    queue: str, batch: Sequence[Entry], span: range
) -> service_pb2.EnqueueBatchRequest:
    """One request for `batch[span]`, its messages built in place (no copies)."""
    request = service_pb2.EnqueueBatchRequest()
    add = request.messages.add
    for index in span:
        headers, payload, delay_ms = batch[index]
        add(queue=queue, headers=headers, payload=payload, delay_ms=delay_ms)
    return request


def enqueue_results(results: Sequence[service_pb2.EnqueueResult]) -> list[str | FilaError]:
    return [r.message_id or map_batch_error(r.error, "Enqueue") for r in results]


def settle_results(results: Sequence[service_pb2.BatchError], rpc: str) -> list[FilaError | None]:
    """Per-item outcomes of AckBatch / NackBatch: None for done (code 0), else the error."""
    return [map_batch_error(r, rpc) if r.code else None for r in results]


def ack_batch_request(queue: str, ids: Sequence[str], span: range) -> service_pb2.AckBatchRequest:
    request = service_pb2.AckBatchRequest()
    add = request.acks.add
    for index in span:
        add(queue=queue, message_id=ids[index])
    return request


def nack_batch_request(
    queue: str, items: Sequence[NackItem], default_error: str, span: range
) -> service_pb2.NackBatchRequest:
    request = service_pb2.NackBatchRequest()
    add = request.nacks.add
    default_error = bounded_error(default_error)
    for index in span:
        item = items[index]
        if isinstance(item, str):
            add(queue=queue, message_id=item, error=default_error)
        else:
            add(queue=queue, message_id=item[0], error=bounded_error(item[1]))
    return request


def chunks(
    sizes: Sequence[int], max_messages: int = MAX_BATCH_MESSAGES, max_bytes: int = MAX_BATCH_BYTES
) -> Iterator[range]:
    """Index ranges over items of the given byte `sizes`, each within both budgets.

    An item larger than `max_bytes` goes alone in its own chunk (the broker then
    answers for it, typically INVALID_ARGUMENT for an oversized message)."""
    start = 0
    total = 0
    for index, size in enumerate(sizes):
        if index > start and (index - start >= max_messages or total + size > max_bytes):
            yield range(start, index)
            start, total = index, 0
        total += size
    if start < len(sizes):
        yield range(start, len(sizes))


class Coalescer(Generic[Item, Result]):
    """Gathers items submitted in one turn of the loop into one call of `send`.

    `send(items)` returns one entry per item: the item's result, or the
    `FilaError` its caller should raise. If `send` raises, every item of that
    batch fails with that exception, so no caller waits forever. The coalescer
    owns the tasks running `send`; `aclose` waits for them.
    """

    def __init__(
        self,
        send: Callable[[list[Item]], Awaitable[Sequence[Result | FilaError]]],
        *,
        max_items: int = MAX_BATCH_MESSAGES,
    ) -> None:
        self._send = send
        self._max_items = max_items
        self._items: list[Item] = []
        self._waiters: list[asyncio.Future[Result]] = []
        self._scheduled = False
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, item: Item) -> asyncio.Future[Result]:
        if self._closed:
            raise ClientClosedError()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Result] = loop.create_future()
        self._items.append(item)
        self._waiters.append(waiter)
        if len(self._items) >= self._max_items:
            self._flush()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return waiter

    def _flush(self) -> None:
        self._scheduled = False
        if not self._items:
            return
        items, waiters = self._items, self._waiters
        self._items, self._waiters = [], []
        task = asyncio.get_running_loop().create_task(self._run(items, waiters))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, items: list[Item], waiters: list[asyncio.Future[Result]]) -> None:
        try:
            results = await self._send(items)
        except Exception as exc:  # a FilaError, or a bug: either way each caller gets it
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(exc)
            return
        except asyncio.CancelledError:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(ClientClosedError())
            raise
        for waiter, result in zip(waiters, results, strict=True):
            if waiter.done():  # its caller gave up (timeout, cancellation)
                continue
            if isinstance(result, FilaError):
                waiter.set_exception(result)
            else:
                waiter.set_result(result)

    async def aclose(self) -> None:
        """Fails what was not sent yet and cancels the batches in flight."""
        self._closed = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(ClientClosedError())
        self._items, self._waiters = [], []
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
