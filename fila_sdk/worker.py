"""`Worker`: runs a handler for every message of a queue, so nobody writes the
consume-ack loop by hand.

    async with AsyncClient(addr) as client:           # async handler
        await Worker(client, "orders", handle, concurrency=32).run()

    with Client(addr) as client:                       # sync handler, thread pool
        Worker(client, "orders", handle, concurrency=8).run()   # Ctrl-C stops it

`Worker(client, ...)` is an `AsyncWorker` for an `AsyncClient` and a `ThreadWorker`
for a `Client`; both run the same engine on an event loop (the blocking client's
private loop thread for a `ThreadWorker`, whose handlers run in a thread pool).

How it works, and why:
- One `StreamConsume` stream carries deliveries in and settlements out. A handler
  that returns acks its message, one that raises nacks it with the exception's
  text and logs a WARNING (rate limited, `fila_sdk.failure_log`); settlements made
  in one turn of the loop travel in one request with no reply (the broker makes them
  durable with its next group commit). A handler's
  own CancelledError is a failure too; the nack's text is cut to a bounded size.
- What is not one message's failure ends the worker (after a graceful stop) with
  an exception for its caller, leaving the message to the broker: a handler that
  raises SystemExit or KeyboardInterrupt (re-raised by `run()` / `join()`, so
  `sys.exit` in a handler still exits the program), or one of the wrong kind (an
  async handler on a `Client`, refused when the worker is built if it can be told,
  or a blocking one on an `AsyncClient`), whose message is never acked.
- `concurrency` slots take messages from a local buffer the stream fills. A slot
  that finishes takes the next message at once, and its settlement gives the
  broker room to send another (`prefetch` bounds what the stream holds, running
  and buffered: twice `concurrency` by default). Nothing polls.
- Lease extension: a message held longer than a third of the queue's visibility
  timeout gets `ExtendLease` (to the queue's full timeout) from a heartbeat task,
  so long handlers keep their messages. The timeout is not sent to consumers:
  pass `visibility_timeout`, or the worker learns it from its first extension
  (`ExtendLease` answers the new deadline, and `leased_at` on the delivery tells
  where the broker's clock stood). A lease found gone (NOT_FOUND) is settled by
  unary call later, never on the stream, since an unknown id on the stream ends it.
- Broker restarts: the stream is opened again with backoff (`fila_sdk.retry`).
  Handlers that were running finish and their results are settled with
  `AckBatch` / `NackBatch` (after a crash the broker still holds their leases).
  Buffered messages not yet started are dropped: the broker puts them back at
  once after a clean shutdown, and at their visibility timeout after a crash.
- Cluster mode: the stream is opened on the queue's node, wherever the client was
  pointed (`fila_sdk.leader`); settlements ride that stream, and orphans settled by
  unary call reach the owner through any node.
- `stop()` (or leaving `async with` / `with`, or SIGINT/SIGTERM with
  `stop_on_signals`) stops taking messages, lets running handlers finish within
  `grace_period`, settles them, then closes the stream: the broker returns what
  the worker still held to the queue at once (as a failed attempt, without
  running `on_failure`). A handler still running after the grace period is
  cancelled (async) or abandoned to its thread (sync); its message is released.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, Final, Self, overload

import grpc

from fila.v1 import service_pb2, service_pb2_grpc

from ._channel import interrupted, map_rpc_error, milliseconds
from .aio import AsyncClient
from .batching import bounded_error
from .client import Client
from .errors import (
    ClientClosedError,
    DeadlineExceededError,
    FilaError,
    MessageNotFoundError,
    RPCError,
    UnavailableError,
)
from .failure_log import FailureLog
from .leader import Follower
from .retry import AsyncProbe, Reconnector, async_probe, retryable
from .streams import CALL_ENDED, method_missing
from .types import Message

log = logging.getLogger("fila_sdk")

AsyncHandler = Callable[[Message], Awaitable[object]]
SyncHandler = Callable[[Message], object]

# Until the visibility timeout is known, held messages are checked this often.
_UNKNOWN_TIMEOUT_TICK_S: Final = 1.0
# How long a stopping worker waits for the broker to end the stream it half-closed.
_CLOSE_TIMEOUT_S: Final = 5.0
# A slot that keeps finding work yields to the loop at least this often, so that
# settlements get written and frames read while fast handlers run back to back.
_YIELD_EVERY_S: Final = 0.001
# Most lease extensions in flight at once.
_EXTEND_CONCURRENCY: Final = 64


@dataclass(slots=True)
class WorkerStats:
    """Counters since the worker started (read them from the worker's loop or thread)."""

    delivered: int = 0  # messages received from the broker
    acked: int = 0  # handler returned
    nacked: int = 0  # handler raised
    released: int = 0  # given back unprocessed (stop, lost stream, handler past grace)
    extended: int = 0  # successful lease extensions
    resubscribed: int = 0  # streams opened again after one ended


@dataclass(frozen=True, slots=True)
class _Options:
    queue: str
    concurrency: int
    prefetch: int
    max_batch: int
    visibility_timeout_s: float | None
    grace_period_s: float

    @classmethod
    def build(
        cls,
        queue: str,
        concurrency: int,
        prefetch: int | None,
        max_batch: int | None,
        visibility_timeout: timedelta | float | None,
        grace_period: timedelta | float,
    ) -> _Options:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        prefetch = 2 * concurrency if prefetch is None else prefetch
        if prefetch < concurrency:
            raise ValueError(f"prefetch ({prefetch}) must be at least concurrency ({concurrency})")
        max_batch = prefetch if max_batch is None else max_batch
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        timeout_s = None
        if visibility_timeout is not None:
            timeout_s = milliseconds(visibility_timeout, "visibility_timeout") / 1000
            if timeout_s <= 0:
                raise ValueError("visibility_timeout must be positive")
        grace_s = milliseconds(grace_period, "grace_period") / 1000
        return cls(queue, concurrency, prefetch, max_batch, timeout_s, grace_s)


class _Session:
    """One `StreamConsume` call: the opening request, then settlements as they come."""

    def __init__(
        self,
        client: AsyncClient,
        options: _Options,
        service: service_pb2_grpc.FilaServiceAsyncStub | None = None,  # a queue's owner
    ) -> None:
        service = service or client._next_service()
        self.call = service.StreamConsume(metadata=client.settings.metadata)  # type: ignore[call-arg]
        self._opening = service_pb2.StreamConsumeRequest(
            queue=options.queue, prefetch=options.prefetch, max_batch=options.max_batch
        )
        self._acks: list[str] = []
        self._nacks: list[tuple[str, str]] = []
        self._wake = asyncio.Event()
        self._finishing = False

    def ack(self, message_id: str) -> None:
        self._acks.append(message_id)
        self._wake.set()

    def nack(self, message_id: str, error: str) -> None:
        self._nacks.append((message_id, error))
        self._wake.set()

    def finish(self) -> None:
        """Write what is pending, then half-close: the broker ends the stream."""
        self._finishing = True
        self._wake.set()

    async def write(self) -> None:
        """Writes until finished; returns quietly when the call ends (the reader of
        the stream reports how it ended)."""
        try:
            await self._write()
        except CALL_ENDED:
            return

    async def _write(self) -> None:
        call = self.call
        await call.write(self._opening)
        while True:
            if not self._acks and not self._nacks:
                if self._finishing:
                    await call.done_writing()
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            request = service_pb2.StreamConsumeRequest(ack_ids=self._acks)
            add = request.nacks.add
            for message_id, error in self._nacks:
                add(message_id=message_id, error=bounded_error(error))
            self._acks, self._nacks = [], []
            await call.write(request)


class _Engine:
    """The worker itself, on one event loop; see the module docstring."""

    def __init__(
        self,
        client: AsyncClient,
        options: _Options,
        handle: Callable[[Message], Awaitable[object]],
        stats: WorkerStats,
    ) -> None:
        self._client = client
        self._options = options
        self._handle = handle
        self.stats = stats
        self._failures = FailureLog(log, options.queue)
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._ready: deque[Message] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()
        # Messages held on the current stream (buffered or running), by id, with the
        # monotonic time their lease was last granted or extended.
        self._held: dict[str, float] = {}
        # Running messages whose stream ended or whose lease was found gone: settled
        # by unary batch calls, never on a stream.
        self._orphans: dict[str, float] = {}
        self._orphan_acks: list[str] = []
        self._orphan_nacks: list[tuple[str, str]] = []
        self._orphan_wake = asyncio.Event()
        # Ids with a unary settlement waiting or in flight: never settled on a stream.
        self._unary_pending: set[str] = set()
        self._connected = asyncio.Event()  # set while a stream is open
        self._connected.set()
        self._session: _Session | None = None
        self._held_wake = asyncio.Event()
        self._timeout_s = options.visibility_timeout_s
        # For learning the visibility timeout: id -> (leased_at ms, monotonic receipt).
        self._lease_origin: dict[str, tuple[int, float]] = {}
        # What a handler did that ends the worker (after a graceful stop) instead of
        # nacking its message; see `_fail`. The caller raises it once `run` returns.
        self.fatal: BaseException | None = None

    def stop(self) -> None:
        self._stopping.set()
        for waiter in self._idle:
            if not waiter.done():
                waiter.set_result(None)

    # -- running ---------------------------------------------------------------------

    async def run(self) -> None:
        """Serves until `stop()`, then stops gracefully; raises what ended it otherwise
        (`BrokerUnreachableError`, `QueueNotFoundError`, or a failure of its own tasks).

        Owns every task it starts: any of them ending on an error ends the worker with
        that error; all are cancelled and awaited before it returns."""
        spawn = self._loop.create_task
        slots = [spawn(self._slot()) for _ in range(self._options.concurrency)]
        helpers = [spawn(self._heartbeat()), spawn(self._settle_orphans())]
        reader = spawn(self._read_streams())
        stopping = spawn(self._stopping.wait())
        working = [*slots, *helpers, reader]
        try:
            await asyncio.wait((*working, stopping), return_when=asyncio.FIRST_COMPLETED)
            _raise_failure(working)
            if not reader.done():  # stop() was called
                await self._drain(slots, reader)
                _raise_failure(working)
        finally:
            owned = [*working, stopping]
            for task in owned:
                task.cancel()
            await asyncio.gather(*owned, return_exceptions=True)
            self._release_all()

    async def _drain(self, slots: list[asyncio.Task[None]], reader: asyncio.Task[None]) -> None:
        """Graceful stop: running handlers finish (within the grace period) and are
        settled, then the stream is half-closed and the broker takes back the rest."""
        self.stop()
        grace = self._options.grace_period_s
        _, late = await asyncio.wait(slots, timeout=grace) if slots else ((), set())
        for task in late:
            task.cancel()
        if late:
            log.warning(
                "worker on %r: %d handler(s) still running after the %gs grace period; "
                "their messages are released",
                self._options.queue,
                len(late),
                grace,
            )
            await asyncio.gather(*late, return_exceptions=True)
        session = self._session
        if session is not None:
            session.finish()
            _, pending = await asyncio.wait((reader,), timeout=_CLOSE_TIMEOUT_S)
            if pending:
                session.call.cancel()
        if self._orphan_acks or self._orphan_nacks:
            await self._flush_orphans()  # once: a stopping worker does not wait for the broker

    def _release_all(self) -> None:
        released = len(self._held) + len(self._orphans)
        self.stats.released += released
        self._held.clear()
        self._orphans.clear()
        self._ready.clear()
        self._lease_origin.clear()

    # -- handler slots ---------------------------------------------------------------

    async def _slot(self) -> None:
        loop = self._loop
        handle = self._handle
        yielded = loop.time()
        while (message := await self._take()) is not None:
            try:
                result = handle(message)
                if not inspect.isawaitable(result):  # a sync handler on an AsyncWorker
                    raise _Fatal(_wrong_kind(handle, result, blocking=False))
                await result
            except _Fatal as fatal:
                self._fail(fatal.error)
                return
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # this worker is being stopped or cancelled
                # The handler's own (it awaited something cancelled): a failure.
                self._settle(message.id, _error_text(exc))
                self._failures.failed(message.id, message.attempt_count + 1, exc)
            except Exception as exc:  # the handler failed: that is what a nack reports
                self._settle(message.id, _error_text(exc))
                self._failures.failed(message.id, message.attempt_count + 1, exc)
            except BaseException as exc:  # SystemExit, KeyboardInterrupt: the program's end
                # Caught here, for a ThreadWorker's handlers too (their exceptions come
                # back through the executor's future): raised from a task, they would
                # end the event loop, which is the client's own for a ThreadWorker.
                self._fail(exc)
                return
            else:
                self._settle(message.id, None)
            now = loop.time()
            if now - yielded >= _YIELD_EVERY_S:
                await asyncio.sleep(0)
                yielded = loop.time()

    def _fail(self, error: BaseException) -> None:
        """Ends the worker with `error` after a graceful stop, leaving the message
        unsettled (the broker takes it back with the rest): acking would lose it, and
        nacking every message for a misuse or a request to exit helps nobody."""
        if self.fatal is None:
            self.fatal = error
        self.stop()

    async def _take(self) -> Message | None:
        ready = self._ready
        while not self._stopping.is_set():
            if ready:
                return ready.popleft()
            waiter = self._loop.create_future()
            self._idle.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()
        return None

    def _deliver(self, messages: list[Message]) -> None:
        now = time.monotonic()
        held = self._held
        for message in messages:
            held[message.id] = now
        self.stats.delivered += len(messages)
        if self._timeout_s is None and messages:
            first = messages[0]
            if first.leased_at is not None:
                self._lease_origin[first.id] = (_epoch_ms(first), now)
        self._ready.extend(messages)
        idle = self._idle
        for _ in range(min(len(idle), len(messages))):
            waiter = idle.popleft()
            if not waiter.done():
                waiter.set_result(None)
        self._held_wake.set()

    def _settle(self, message_id: str, error: str | None) -> None:
        self._lease_origin.pop(message_id, None)
        if error is None:
            self.stats.acked += 1
        else:
            self.stats.nacked += 1
        session = self._session
        on_stream = self._held.pop(message_id, None) is not None and session is not None
        if on_stream and message_id not in self._unary_pending:
            assert session is not None
            if error is None:
                session.ack(message_id)
            else:
                session.nack(message_id, error)
            return
        # From a stream that ended, or whose lease was found gone, or with a unary
        # settlement of an earlier delivery still pending (which may settle this
        # delivery's lease: the stream must then not name it).
        self._orphans.pop(message_id, None)
        self._unary_pending.add(message_id)
        if error is None:
            self._orphan_acks.append(message_id)
        else:
            self._orphan_nacks.append((message_id, error))
        self._orphan_wake.set()

    # -- the stream ------------------------------------------------------------------

    async def _read_streams(self) -> None:
        client, options = self._client, self._options
        settings = client.settings
        reconnector = Reconnector(
            f"worker on {options.queue!r}", settings.target, settings.reconnect_timeout
        )
        probe = async_probe(client._channel)
        follower = Follower(client._leaders, f"worker on {options.queue!r}")  # cluster mode
        from_proto = Message.from_proto
        while True:
            owner = follower.service if follower.addr else None  # else round-robin, as ever
            session = self._session = _Session(client, options, owner)
            writer = self._loop.create_task(session.write())
            error: FilaError | None = None
            redirected = False
            try:
                async for frame in session.call:
                    if reconnector.backing_off:
                        reconnector.delivered()
                    if follower.hops:
                        follower.delivered()
                    batch = frame.messages
                    if batch:
                        self._deliver([from_proto(m) for m in batch])
                    elif frame.HasField("message"):
                        self._deliver([from_proto(frame.message)])
            except grpc.RpcError as err:
                self._session = None  # (see below) before `_stream_error` awaits
                redirected = follower.follow(err)
                if not redirected:
                    follower.lost()
                    error = await self._stream_error(err)
            except asyncio.CancelledError:
                # grpc.aio ends a call whose channel was closed with CancelledError:
                # that one means the client was closed, not this task cancelled.
                task = asyncio.current_task()
                if not client.closed or task is None or task.cancelling():
                    raise
            finally:
                # Before anything awaits: a handler finishing from now on must not
                # settle on the dead stream, whose settlements nobody applies.
                self._session = None
                self._lose_stream()
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
            if self._stopping.is_set():
                return
            if client.closed:
                raise ClientClosedError("the client was closed under a running worker")
            if redirected:  # the queue's owner is elsewhere: open the stream there now
                self._connected.set()
                continue
            if error is None:
                error = UnavailableError("the broker ended the stream", grpc.StatusCode.UNAVAILABLE)
            if isinstance(error, MessageNotFoundError):
                # A settlement named a lease this stream no longer held (it expired):
                # the broker ended the stream and took its leases back.
                log.warning("worker on %r: %s; resubscribing", options.queue, error)
            elif not retryable(error):
                raise error
            self.stats.resubscribed += 1
            await self._wait_for_broker(reconnector, error, probe)
            self._connected.set()

    async def _stream_error(self, err: grpc.RpcError) -> FilaError:
        """What ended the stream. INTERNAL may hide the real status (see
        `streams.method_missing`): a broker without StreamConsume cannot serve a
        Worker; anything else is taken as the broker going away."""
        if not interrupted(err):
            return map_rpc_error(err, "StreamConsume")
        client = self._client
        service = client._next_service()
        metadata = client.settings.metadata
        if await method_missing(lambda: service.StreamConsume(metadata=metadata)):  # type: ignore[call-arg]
            return RPCError(
                "the broker does not offer StreamConsume, which Worker needs",
                grpc.StatusCode.UNIMPLEMENTED,
            )
        return UnavailableError(
            f"the stream was interrupted ({err.details()})", grpc.StatusCode.UNAVAILABLE
        )

    async def _wait_for_broker(
        self, reconnector: Reconnector, error: FilaError, probe: AsyncProbe
    ) -> None:
        spawn = self._loop.create_task
        stopping = spawn(self._stopping.wait())
        closing = spawn(self._client._closing_event().wait())
        waiting = spawn(reconnector.wait_async(error, probe))
        tasks = (stopping, closing, waiting)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._stopping.is_set():
            return
        if self._client.closed:  # not a stop: say so, as when the stream was open
            raise ClientClosedError("the client was closed under a running worker")
        waiting.result()  # BrokerUnreachableError when it gave up

    def _lose_stream(self) -> None:
        """The stream ended: buffered messages are the broker's again; running ones
        become orphans, settled by unary calls when their handlers finish."""
        held = self._held
        for message in self._ready:
            if held.pop(message.id, None) is not None:
                self.stats.released += 1
            self._lease_origin.pop(message.id, None)
        self._ready.clear()
        self._orphans.update(held)
        held.clear()
        self._connected.clear()

    # -- orphan settlement -----------------------------------------------------------

    async def _settle_orphans(self) -> None:
        while True:
            await self._orphan_wake.wait()
            self._orphan_wake.clear()
            if not await self._flush_orphans():
                # The broker is away. After a crash it still holds these leases when it
                # is back, so settling them then spares a redelivery.
                await self._connected.wait()
                self._orphan_wake.set()

    async def _flush_orphans(self) -> bool:
        """Settles orphans by unary batch calls; False if some must wait for the broker
        to be back (they are kept for the next flush)."""
        acks, nacks = self._orphan_acks, self._orphan_nacks
        self._orphan_acks, self._orphan_nacks = [], []
        queue = self._options.queue
        settled = True
        if acks:
            outcomes = await self._client.ack_many(queue, acks)
            for message_id, outcome in zip(acks, outcomes, strict=True):
                if self._orphan_failed(outcome):
                    self._orphan_acks.append(message_id)
                    settled = False
                else:
                    self._unary_settled(message_id)
        if nacks:
            outcomes = await self._client.nack_many(queue, nacks)
            for item, outcome in zip(nacks, outcomes, strict=True):
                if self._orphan_failed(outcome):
                    self._orphan_nacks.append(item)
                    settled = False
                else:
                    self._unary_settled(item[0])
        return settled

    def _unary_settled(self, message_id: str) -> None:
        """A unary settlement is done. If the id was delivered again meanwhile, that
        settlement may have ended the new lease too: forget the new delivery's lease
        (its handler, if it runs, settles by unary call and meets NOT_FOUND)."""
        self._unary_pending.discard(message_id)
        self._held.pop(message_id, None)

    def _orphan_failed(self, outcome: FilaError | None) -> bool:
        """True if the settlement should be tried again once the broker is back."""
        if outcome is None:
            return False
        queue = self._options.queue
        if isinstance(outcome, MessageNotFoundError):
            # Its lease ended with the stream (a clean broker shutdown) or expired: the
            # message is ready again and will be delivered again.
            log.info("worker on %r: settled too late, redelivered: %s", queue, outcome)
            return False
        if retryable(outcome) or isinstance(outcome, DeadlineExceededError):
            return True
        log.warning("worker on %r: settlement failed: %s", queue, outcome)
        return False

    # -- lease extension -------------------------------------------------------------

    async def _heartbeat(self) -> None:
        while True:
            if self._timeout_s is None:
                await self._learn_timeout()
                continue
            period = self._timeout_s / 3
            await asyncio.sleep(period / 2)
            if not self._connected.is_set():
                continue  # the broker is away: extensions would only fail (and log)
            now = time.monotonic()
            due = [
                message_id
                for table in (self._held, self._orphans)
                for message_id, since in table.items()
                if now - since >= period
            ]
            if due:
                await self._extend(due)

    async def _learn_timeout(self) -> None:
        """Extends the oldest held message by the queue's own timeout and derives the
        timeout from the answer: deadline - leased_at - time held since delivery."""
        if not self._held:
            self._held_wake.clear()
            await self._held_wake.wait()
        candidates = [mid for mid in self._held if mid in self._lease_origin]
        if not candidates:
            await asyncio.sleep(_UNKNOWN_TIMEOUT_TICK_S)
            return
        message_id = candidates[0]
        leased_at_ms, received = self._lease_origin[message_id]
        try:
            deadline = await self._client.extend_lease(self._options.queue, message_id)
        except MessageNotFoundError:
            self._lease_origin.pop(message_id, None)
            return  # settled meanwhile: try the next one
        except FilaError as exc:
            log.debug("worker on %r: lease probe failed: %s", self._options.queue, exc)
            await asyncio.sleep(_UNKNOWN_TIMEOUT_TICK_S)
            return
        held_s = time.monotonic() - received
        timeout_ms = deadline.timestamp() * 1000 - leased_at_ms - held_s * 1000
        self._timeout_s = max(timeout_ms, 1.0) / 1000
        self._lease_origin.clear()
        if message_id in self._held:
            self._held[message_id] = time.monotonic()
        log.debug(
            "worker on %r: visibility timeout is about %.3fs",
            self._options.queue,
            self._timeout_s,
        )

    async def _extend(self, message_ids: list[str]) -> None:
        gate = asyncio.Semaphore(_EXTEND_CONCURRENCY)
        queue = self._options.queue

        async def extend(message_id: str) -> None:
            async with gate:
                try:
                    await self._client.extend_lease(queue, message_id)
                except MessageNotFoundError:
                    self._lease_gone(message_id)
                    return
                except FilaError as exc:
                    log.warning("worker on %r: extending %s failed: %s", queue, message_id, exc)
                    return
            self.stats.extended += 1
            now = time.monotonic()
            if message_id in self._held:
                self._held[message_id] = now
            elif message_id in self._orphans:
                self._orphans[message_id] = now

        await asyncio.gather(*(extend(m) for m in message_ids))

    def _lease_gone(self, message_id: str) -> None:
        """The broker no longer holds this lease (it expired): never settle it on the
        stream; if it was not started, forget it (it will be delivered again)."""
        if self._held.pop(message_id, None) is None:
            self._orphans.pop(message_id, None)
            return
        for message in self._ready:
            if message.id == message_id:
                self._ready.remove(message)
                self.stats.released += 1
                return
        self._orphans[message_id] = time.monotonic()


def _raise_failure(tasks: list[asyncio.Task[None]]) -> None:
    """Raises the error of the first task that ended on one (cancelled ones aside)."""
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            task.result()


class _Fatal(Exception):
    """Carries what must end the worker rather than nack a message (see
    `_Engine._fail`), out of a handler's thread as well."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _error_text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _is_async(handler: object) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    call = getattr(handler, "__call__", None)  # noqa: B004 (its kind, not callable())
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)


def _wrong_kind(handler: object, result: object, *, blocking: bool) -> TypeError:
    if blocking:
        return TypeError(
            f"handler {handler!r} returned {type(result).__name__}: a ThreadWorker (on a "
            "Client) needs a blocking handler; use AsyncClient for an async one"
        )
    return TypeError(
        f"handler {handler!r} returned {type(result).__name__}: an AsyncWorker (on an "
        "AsyncClient) needs an async handler; use Client for a blocking one"
    )


def _epoch_ms(message: Message) -> int:
    assert message.leased_at is not None
    return round(message.leased_at.timestamp() * 1000)


class Worker:
    """Runs `handler` for every message of `queue`; see the module docstring.

    `Worker(AsyncClient, queue, async_handler, ...)` is an `AsyncWorker`;
    `Worker(Client, queue, sync_handler, ...)` is a `ThreadWorker`.
    """

    stats: WorkerStats

    @overload
    def __new__(
        cls,
        client: AsyncClient,
        queue: str,
        handler: AsyncHandler,
        *,
        concurrency: int = ...,
        prefetch: int | None = ...,
        max_batch: int | None = ...,
        visibility_timeout: timedelta | float | None = ...,
        grace_period: timedelta | float = ...,
    ) -> AsyncWorker: ...

    @overload
    def __new__(
        cls,
        client: Client,
        queue: str,
        handler: SyncHandler,
        *,
        concurrency: int = ...,
        prefetch: int | None = ...,
        max_batch: int | None = ...,
        visibility_timeout: timedelta | float | None = ...,
        grace_period: timedelta | float = ...,
    ) -> ThreadWorker: ...

    def __new__(cls, client: AsyncClient | Client, *args: Any, **kwargs: Any) -> Worker:
        if cls is Worker:
            cls = AsyncWorker if isinstance(client, AsyncClient) else ThreadWorker
        return object.__new__(cls)


class AsyncWorker(Worker):
    """A `Worker` with an async handler on an `AsyncClient`, on the caller's loop."""

    def __init__(
        self,
        client: AsyncClient,
        queue: str,
        handler: AsyncHandler,
        *,
        concurrency: int = 1,
        prefetch: int | None = None,
        max_batch: int | None = None,
        visibility_timeout: timedelta | float | None = None,
        grace_period: timedelta | float = 30.0,
    ) -> None:
        if not isinstance(client, AsyncClient):
            raise TypeError("AsyncWorker needs an AsyncClient (use Client for ThreadWorker)")
        self._client = client
        self._handler = handler
        self._options = _Options.build(
            queue, concurrency, prefetch, max_batch, visibility_timeout, grace_period
        )
        self.stats = WorkerStats()
        self._engine: _Engine | None = None
        self._stop_requested = False
        self._task: asyncio.Task[None] | None = None

    async def run(self, *, stop_on_signals: bool = False) -> None:
        """Serve until `stop()`, then stop gracefully. With `stop_on_signals`, SIGINT
        and SIGTERM call `stop()` while it runs (main thread only). Cancelling the
        task that runs it stops at once instead: handlers are cancelled and the
        broker takes every held message back."""
        if self._engine is not None:
            raise RuntimeError("this worker is already running")
        loop = asyncio.get_running_loop()
        engine = self._engine = _Engine(self._client, self._options, self._handler, self.stats)
        if self._stop_requested:
            engine.stop()
        with _signals_call(self.stop, loop if stop_on_signals else None):
            try:
                await engine.run()
            finally:
                self._engine = None
                self._stop_requested = False  # that stop was this run's: run again later
        if engine.fatal is not None:
            raise engine.fatal

    def stop(self) -> None:
        """Stop taking messages and finish gracefully; safe from any thread. Before
        `run()`, that run returns at once."""
        self._stop_requested = True
        engine = self._engine
        if engine is None:
            return
        loop = engine._loop
        if _on_loop(loop):
            engine.stop()
        else:
            loop.call_soon_threadsafe(engine.stop)

    async def __aenter__(self) -> Self:
        """Runs the worker in a task of its own until the block ends."""
        self._task = asyncio.get_running_loop().create_task(self.run())
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():  # else a stop() would be left for the next run
            self.stop()
        await task


class ThreadWorker(Worker):
    """A `Worker` with a blocking handler on a `Client`: handlers run in a pool of
    `concurrency` threads, the stream on the client's private loop thread."""

    def __init__(
        self,
        client: Client,
        queue: str,
        handler: SyncHandler,
        *,
        concurrency: int = 1,
        prefetch: int | None = None,
        max_batch: int | None = None,
        visibility_timeout: timedelta | float | None = None,
        grace_period: timedelta | float = 30.0,
    ) -> None:
        if not isinstance(client, Client):
            raise TypeError("ThreadWorker needs a Client (use AsyncClient for AsyncWorker)")
        if _is_async(handler):  # its calls would return coroutines nobody runs
            raise TypeError(
                f"handler {handler!r} is async: a ThreadWorker (on a Client) runs blocking "
                "handlers in threads; use AsyncClient for an async one"
            )
        self._client = client
        self._handler = handler
        self._options = _Options.build(
            queue, concurrency, prefetch, max_batch, visibility_timeout, grace_period
        )
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._engine: _Engine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False  # for the current run, or the next one
        self._running = False  # from start() to the end of `_serve`
        # What ended the run: a handler's SystemExit, KeyboardInterrupt or misuse.
        self._done: concurrent.futures.Future[BaseException | None] | None = None

    def start(self) -> None:
        """Start serving in the background; `stop()` and `join()` end it."""
        with self._lock:
            if self._done is not None and not self._done.done():
                raise RuntimeError("this worker is already running")
            loop_thread, twin = self._client.streams()
            self._running = True
            self._loop = loop_thread.loop
            self._done = loop_thread.submit(self._serve(twin))

    async def _serve(self, twin: AsyncClient) -> BaseException | None:
        """Returns (never raises) what must end the worker in the caller's thread: a
        SystemExit raised on the client's loop would end that loop, not the program."""
        loop = asyncio.get_running_loop()
        handler = self._handler
        pool = concurrent.futures.ThreadPoolExecutor(
            self._options.concurrency, thread_name_prefix=f"fila-worker-{self._options.queue}"
        )

        def call(message: Message) -> object:
            result = handler(message)  # what it raises, `_Engine._slot` handles
            if inspect.isawaitable(result):  # never ack what did not run
                if inspect.iscoroutine(result):
                    result.close()
                raise _Fatal(_wrong_kind(handler, result, blocking=True))
            return result

        async def handle(message: Message) -> object:
            return await loop.run_in_executor(pool, call, message)

        engine = _Engine(twin, self._options, handle, self.stats)
        with self._lock:
            self._engine = engine
            if self._stop_requested:
                engine.stop()
        try:
            await engine.run()
        finally:
            with self._lock:
                self._engine = None
                self._running = False
                self._stop_requested = False  # that stop was this run's: start again later
            # A handler past the grace period cannot be interrupted; do not wait for it.
            pool.shutdown(wait=False, cancel_futures=True)
        return engine.fatal

    def stop(self) -> None:
        """Stop taking messages and finish gracefully; safe from any thread and from a
        signal handler. `join()` waits for the end. Before `start()`, that run ends at
        once."""
        self._stop(pending=True)

    def _stop(self, *, pending: bool) -> None:
        """Stops the current run; with `pending`, the next one if none runs."""
        with self._lock:
            if not (pending or self._running):
                return
            self._stop_requested = True
            engine, loop = self._engine, self._loop
        if engine is not None and loop is not None:
            loop.call_soon_threadsafe(engine.stop)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker to end; raises what ended it if it was not `stop()`,
        including a handler's SystemExit or KeyboardInterrupt."""
        done = self._done
        if done is None:
            return
        try:
            fatal = done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"worker still running after {timeout}s") from None
        except concurrent.futures.CancelledError:
            raise ClientClosedError("the client was closed under a running worker") from None
        if fatal is not None:
            raise fatal

    def run(self, *, stop_on_signals: bool = True) -> None:
        """Serve in this thread until `stop()`. SIGINT (Ctrl-C) and SIGTERM stop the
        worker gracefully when `stop_on_signals` and this is the main thread."""
        self.start()
        done = self._done
        with _signals_call(self.stop, None, sync=stop_on_signals):
            while True:
                try:
                    self.join()
                    return
                except KeyboardInterrupt:
                    if done is None or done.done():
                        raise  # a handler's: the worker ended on it
                    self.stop()  # no handler installed: stop gracefully anyway

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop(pending=False)
        self.join()


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


_STOP_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _signals_call(
    stop: Callable[[], None], loop: asyncio.AbstractEventLoop | None, *, sync: bool = False
) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM call `stop` (through `loop` when given, else
    with `signal.signal` when `sync`); only possible in the main thread."""
    if threading.current_thread() is not threading.main_thread() or (loop is None and not sync):
        yield
        return
    if loop is not None:
        for signum in _STOP_SIGNALS:
            loop.add_signal_handler(signum, stop)
        try:
            yield
        finally:
            for signum in _STOP_SIGNALS:
                loop.remove_signal_handler(signum)
        return
    previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}

    def on_signal(signum: int, frame: object) -> None:
        log.info("worker stopping on signal %s", signal.Signals(signum).name)
        stop()

    for signum in _STOP_SIGNALS:
        signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
