"""The worker's two faces over one engine: `AsyncWorker` (an async handler on an
`AsyncClient`, on the caller's loop) and `ThreadWorker` (a blocking handler on a
`Client`, in a thread pool, the engine on the client's private loop thread).
`Worker(client, ...)` picks the face for the client. What both do (the arguments,
one run of the engine, a stop asked for before or during a run) is `Worker`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Awaitable, Callable
from datetime import timedelta
from types import TracebackType
from typing import Any, Self, overload

from ..aio import AsyncClient
from ..client import Client
from ..errors import ClientClosedError
from ..types import Message
from .engine import Engine
from .handlers import AsyncHandler, Fatal, SyncHandler, is_async, wrong_kind
from .options import Options, WorkerStats
from .signals import signals_call


class Worker:
    """Runs `handler` for every message of `queue`: a handler that returns acks its
    message, one that raises nacks it (see `fila_sdk.worker`).

    `Worker(AsyncClient, queue, async_handler, ...)` is an `AsyncWorker`;
    `Worker(Client, queue, sync_handler, ...)` is a `ThreadWorker`. `concurrency`
    handlers run at once; `prefetch` bounds the messages the stream holds, running and
    buffered (twice `concurrency` by default), and `max_batch` the messages per frame
    (`prefetch` by default). `visibility_timeout` is the queue's, if known (else the
    worker learns it from its first lease extension). `grace_period` is how long a
    stopping worker lets running handlers finish.

    Raises `ValueError` for a `concurrency` or `max_batch` below 1, a `prefetch` below
    `concurrency` or a non-positive `visibility_timeout`, and `TypeError` for a client
    or handler of the wrong kind (an async handler on a `Client`).
    """

    stats: WorkerStats
    """Counters since the worker started."""

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

    def _setup(self, options: Options) -> None:
        self._options = options
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._stop_requested = False  # for the current run, or the next one
        self._running = False  # from the start of a run to the end of `_serve`

    async def _serve(
        self, client: AsyncClient, handle: Callable[[Message], Awaitable[object]]
    ) -> BaseException | None:
        """One run of the engine on the running loop, until it stops. Returns what a
        handler did that ended it (see `Engine.fail`) rather than raising it: for a
        `ThreadWorker`, a SystemExit raised on the client's loop would end that loop,
        not the program."""
        engine = Engine(client, self._options, handle, self.stats)
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
                self._stop_requested = False  # that stop was this run's: run again later
        return engine.fatal

    def _stop(self, *, pending: bool) -> None:
        """Stops the current run; with `pending`, the next one if none runs."""
        with self._lock:
            if not (pending or self._running):
                return
            self._stop_requested = True
            engine = self._engine
        if engine is not None:
            engine.stop_threadsafe()

    def stop(self) -> None:
        """Stop taking messages and finish gracefully: running handlers finish within
        the grace period and are settled, then the broker takes back what the worker
        still held. Safe from any thread and from a signal handler. Before the worker
        runs, its next run ends at once."""
        self._stop(pending=True)


class AsyncWorker(Worker):
    """A `Worker` with an async handler on an `AsyncClient`, on the caller's loop.
    Raises `TypeError` for another client."""

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
        self._setup(
            Options.build(queue, concurrency, prefetch, max_batch, visibility_timeout, grace_period)
        )
        self._task: asyncio.Task[None] | None = None

    async def run(self, *, stop_on_signals: bool = False) -> None:
        """Serve until `stop()`, then stop gracefully. With `stop_on_signals`, SIGINT
        and SIGTERM call `stop()` while it runs (main thread only). Cancelling the
        task that runs it stops at once instead: handlers are cancelled and the
        broker takes every held message back.

        Raises `RuntimeError` if it is already running; what ended it if not `stop()`
        (`BrokerUnreachableError`, `QueueNotFoundError`, `ClientClosedError`, ...),
        including a handler's SystemExit or KeyboardInterrupt, or the `TypeError` of
        a blocking handler."""
        with self._lock:
            if self._running:
                raise RuntimeError("this worker is already running")
            self._running = True
        loop = asyncio.get_running_loop()
        try:
            with signals_call(self.stop, loop if stop_on_signals else None):
                fatal = await self._serve(self._client, self._handler)
        finally:
            self._running = False
        if fatal is not None:
            raise fatal

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
        """Stops the worker gracefully and waits for it; raises what `run` raised."""
        task, self._task = self._task, None
        if task is None:
            return
        if not task.done():  # else a stop() would be left for the next run
            self.stop()
        await task


class ThreadWorker(Worker):
    """A `Worker` with a blocking handler on a `Client`: handlers run in a pool of
    `concurrency` threads, the stream on the client's private loop thread. Raises
    `TypeError` for another client or an async handler."""

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
        if is_async(handler):  # its calls would return coroutines nobody runs
            raise TypeError(
                f"handler {handler!r} is async: a ThreadWorker (on a Client) runs blocking "
                "handlers in threads; use AsyncClient for an async one"
            )
        self._client = client
        self._handler = handler
        self._setup(
            Options.build(queue, concurrency, prefetch, max_batch, visibility_timeout, grace_period)
        )
        # What ended the run: a handler's SystemExit, KeyboardInterrupt or misuse.
        self._done: concurrent.futures.Future[BaseException | None] | None = None

    def start(self) -> None:
        """Start serving in the background; `stop()` and `join()` end it. Raises
        `RuntimeError` if it is already running, `ClientClosedError` if the client is
        closed."""
        with self._lock:
            if self._done is not None and not self._done.done():
                raise RuntimeError("this worker is already running")
            loop_thread, twin = self._client.streams()
            self._running = True
            self._done = loop_thread.submit(self._serve_in_threads(twin))

    async def _serve_in_threads(self, twin: AsyncClient) -> BaseException | None:
        loop = asyncio.get_running_loop()
        handler = self._handler
        pool = concurrent.futures.ThreadPoolExecutor(
            self._options.concurrency, thread_name_prefix=f"fila-worker-{self._options.queue}"
        )

        def call(message: Message) -> object:
            result = handler(message)  # what it raises, `Engine._slot` handles
            if inspect.isawaitable(result):  # never ack what did not run
                if inspect.iscoroutine(result):
                    result.close()
                raise Fatal(wrong_kind(handler, result, blocking=True))
            return result

        async def handle(message: Message) -> object:
            return await loop.run_in_executor(pool, call, message)

        try:
            return await self._serve(twin, handle)
        finally:
            # A handler past the grace period cannot be interrupted; do not wait for it.
            pool.shutdown(wait=False, cancel_futures=True)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the worker to end; raises what ended it if it was not `stop()`,
        including a handler's SystemExit or KeyboardInterrupt, `TimeoutError` if it is
        still running after `timeout` seconds, and `ClientClosedError` if the client was
        closed under it."""
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
        worker gracefully when `stop_on_signals` and this is the main thread. Raises as
        `start` and `join`."""
        self.start()
        done = self._done
        with signals_call(self.stop, None, sync=stop_on_signals):
            while True:
                try:
                    self.join()
                    return
                except KeyboardInterrupt:
                    if done is None or done.done():
                        raise  # a handler's: the worker ended on it
                    self.stop()  # no handler installed: stop gracefully anyway

    def __enter__(self) -> Self:
        """Starts the worker (`start`)."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stops the worker gracefully and waits for it (`join`)."""
        self._stop(pending=False)
        self.join()
