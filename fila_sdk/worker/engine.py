"""The worker itself, on one event loop: a buffer the stream fills, and the slots that
run the handler.

`concurrency` slots take messages from a local buffer the stream fills. A slot that
finishes takes the next message at once, and its settlement gives the broker room to
send another (`prefetch` bounds what the stream holds, running and buffered). Nothing
polls. The engine owns the tasks of its parts: the stream (`stream.Stream`), the
orphans' settlement (`settlement.Settlement`) and the lease heartbeat
(`leases.Leases`); any of them ending on an error ends the worker.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Final

from ..aio import AsyncClient
from ..failure_log import FailureLog
from ..types import Message
from .handlers import Fatal, error_text, wrong_kind
from .leases import Leases
from .options import Options, WorkerStats
from .settlement import Settlement
from .stream import Stream

log = logging.getLogger("fila_sdk")

# A slot that keeps finding work yields to the loop at least this often, so that
# settlements get written and frames read while fast handlers run back to back.
_YIELD_EVERY_S: Final = 0.001


class Engine:
    """One run of a worker; see the module docstring. `handle` returns an awaitable
    (a result that is not one means a blocking handler on an `AsyncWorker`)."""

    def __init__(
        self,
        client: AsyncClient,
        options: Options,
        handle: Callable[[Message], Awaitable[object]],
        stats: WorkerStats,
    ) -> None:
        self._options = options
        self._handle = handle
        self.stats = stats
        self._failures = FailureLog(log, options.queue)
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        self._ready: deque[Message] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()
        connected = asyncio.Event()  # the stream's: set while one is open
        self._leases = Leases(client, options, connected, self._drop_buffered, stats)
        self._settlement = Settlement(client, options, self._leases, connected, stats)
        self._stream = Stream(
            client,
            options,
            self._settlement,
            self._deliver,
            self._lose_buffer,
            self._stopping,
            connected,
            stats,
        )
        # What a handler did that ends the worker (after a graceful stop) instead of
        # nacking its message; see `fail`. The caller raises it once `run` returns.
        self.fatal: BaseException | None = None

    def stop(self) -> None:
        """Stop taking messages; `run` then finishes gracefully. On the engine's loop."""
        self._stopping.set()
        for waiter in self._idle:
            if not waiter.done():
                waiter.set_result(None)

    def stop_threadsafe(self) -> None:
        """`stop`, from any thread (or a signal handler)."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self.stop()
        else:
            self._loop.call_soon_threadsafe(self.stop)

    async def run(self) -> None:
        """Serves until `stop()`, then stops gracefully; raises what ended it otherwise
        (`BrokerUnreachableError`, `QueueNotFoundError`, or a failure of its own tasks).

        Owns every task it starts: any of them ending on an error ends the worker with
        that error; all are cancelled and awaited before it returns."""
        spawn = self._loop.create_task
        slots = [spawn(self._slot()) for _ in range(self._options.concurrency)]
        helpers = [spawn(self._leases.heartbeat()), spawn(self._settlement.run())]
        reader = spawn(self._stream.read())
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
            self.stats.released += self._leases.release_all()
            self._ready.clear()

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
        await self._stream.finish(reader)
        if self._settlement.pending:
            await self._settlement.flush()  # once: a stopping worker does not wait for the broker

    # -- the buffer ------------------------------------------------------------------

    def _deliver(self, messages: list[Message]) -> None:
        self._leases.delivered(messages)
        self.stats.delivered += len(messages)
        self._ready.extend(messages)
        idle = self._idle
        for _ in range(min(len(idle), len(messages))):
            waiter = idle.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _lose_buffer(self) -> None:
        """The stream ended: buffered messages are the broker's again; running ones
        become orphans, settled by unary calls when their handlers finish."""
        self.stats.released += self._leases.stream_lost(m.id for m in self._ready)
        self._ready.clear()

    def _drop_buffered(self, message_id: str) -> bool:
        """The lease of `message_id` is gone: drop it if it was not started yet."""
        for message in self._ready:
            if message.id == message_id:
                self._ready.remove(message)
                self.stats.released += 1
                return True
        return False

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

    # -- handler slots ---------------------------------------------------------------

    async def _slot(self) -> None:
        loop = self._loop
        handle = self._handle
        settle = self._settlement.settle
        yielded = loop.time()
        while (message := await self._take()) is not None:
            try:
                result = handle(message)
                if not inspect.isawaitable(result):  # a sync handler on an AsyncWorker
                    raise Fatal(wrong_kind(handle, result, blocking=False))
                await result
            except Fatal as fatal:
                self.fail(fatal.error)
                return
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if task is None or task.cancelling():
                    raise  # this worker is being stopped or cancelled
                # The handler's own (it awaited something cancelled): a failure.
                settle(message.id, error_text(exc))
                self._failures.failed(message.id, message.attempt_count + 1, exc)
            except Exception as exc:  # the handler failed: that is what a nack reports
                settle(message.id, error_text(exc))
                self._failures.failed(message.id, message.attempt_count + 1, exc)
            except BaseException as exc:  # SystemExit, KeyboardInterrupt: the program's end
                # Caught here, for a ThreadWorker's handlers too (their exceptions come
                # back through the executor's future): raised from a task, they would
                # end the event loop, which is the client's own for a ThreadWorker.
                self.fail(exc)
                return
            else:
                settle(message.id, None)
            now = loop.time()
            if now - yielded >= _YIELD_EVERY_S:
                await asyncio.sleep(0)
                yielded = loop.time()

    def fail(self, error: BaseException) -> None:
        """Ends the worker with `error` after a graceful stop, leaving the message
        unsettled (the broker takes it back with the rest): acking would lose it, and
        nacking every message for a misuse or a request to exit helps nobody."""
        if self.fatal is None:
            self.fatal = error
        self.stop()


def _raise_failure(tasks: list[asyncio.Task[None]]) -> None:
    """Raises the error of the first task that ended on one (cancelled ones aside)."""
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            task.result()
