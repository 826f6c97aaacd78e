"""A private event loop on a thread of its own: how the blocking `Client` streams.

`Client.enqueue` rides an open `StreamEnqueue` stream and `Worker` drives a
`StreamConsume` stream; both need something reading the stream while callers
block. Rather than a second implementation of the stream protocols with threads
and queues, `Client` runs the `AsyncClient` machinery (`fila_sdk.streams`,
`fila_sdk.worker`) on this loop: a blocking call submits a coroutine and waits
for its result. Calls from many threads land on the same loop and coalesce into
the same requests, exactly as concurrent tasks do on `AsyncClient`.

The thread is a daemon so that a client that was never closed cannot keep the
interpreter alive; `close` stops it and waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Runs `coro` on the loop; the returned future has its result or exception."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Runs `coro` on the loop and blocks until it is done."""
        return self.submit(coro).result()

    @property
    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def stop(self) -> None:
        """Cancels what still runs on the loop (a worker the client was closed under)
        and waits for it to end, then stops the loop and waits for the thread."""
        if self._thread.is_alive():
            self.submit(_cancel_others()).result()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()


async def _cancel_others() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
