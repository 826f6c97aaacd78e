"""A job queue with `Worker`: enqueue jobs, handle them, retry failures, stop cleanly.

Run a broker (`./scripts/serve.sh`), then:

    python examples/worker.py            # blocking handlers in a thread pool
    python examples/worker.py --async    # async handlers on asyncio

It enqueues 20 jobs (one scheduled 2 s later) and runs a worker until all of them
are done. A handler that returns acks its job; one that raises nacks it with the
exception's text, and the queue's `on_failure` hook retries it after a short delay
(job 7 fails on its first attempt). Ctrl-C (or SIGTERM) stops the worker
gracefully: running jobs finish and are acked, the rest go back to the queue.
Safe to run again: the queue is created only if it does not exist.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from fila_sdk import AsyncClient, Client, EnqueueItem, Message, Worker

QUEUE = "jobs"
JOBS = 20
RETRY_LATER = """
function on_failure(msg)
  if msg.attempts >= 3 then return { action = "dlq" } end
  return { action = "retry", delay_ms = 200 }
end
"""


def jobs() -> list[EnqueueItem]:
    items = [EnqueueItem({"job": str(i)}, f"job {i}".encode()) for i in range(JOBS - 1)]
    items.append(EnqueueItem({"job": "scheduled"}, b"run me in 2 s", delay=2.0))
    return items


def work(message: Message) -> None:
    if message.headers.get("job") == "7" and message.attempt_count == 0:
        raise RuntimeError("flaky dependency, try again")
    time.sleep(0.05)  # the job's actual work


def run_threads(addr: str) -> None:
    with Client(addr) as client:
        client.create_queue(QUEUE, on_failure=RETRY_LATER, exist_ok=True)
        client.enqueue_many(QUEUE, jobs())
        done = threading.Semaphore(0)

        def handle(message: Message) -> None:
            work(message)  # raises for job 7's first attempt: nacked, retried
            # one write per line, so that lines from the pool's threads do not interleave
            print(f"done: {message.payload.decode()} (attempt {message.attempt_count})\n", end="")
            done.release()

        with Worker(client, QUEUE, handle, concurrency=4):
            for _ in range(JOBS):
                done.acquire()
        # A service would call `Worker(...).run()` instead: it blocks until Ctrl-C or
        # SIGTERM, then stops gracefully.


async def run_async(addr: str) -> None:
    async with AsyncClient(addr) as client:
        await client.create_queue(QUEUE, on_failure=RETRY_LATER, exist_ok=True)
        await client.enqueue_many(QUEUE, jobs())
        remaining = JOBS
        all_done = asyncio.Event()

        async def handle(message: Message) -> None:
            nonlocal remaining
            await asyncio.to_thread(work, message)
            print(f"done: {message.payload.decode()} (attempt {message.attempt_count})")
            remaining -= 1
            if remaining == 0:
                all_done.set()

        async with Worker(client, QUEUE, handle, concurrency=4):
            await all_done.wait()
        # A service would `await Worker(...).run(stop_on_signals=True)`.


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--async"]
    address = args[0] if args else "localhost:5555"
    if "--async" in sys.argv:
        asyncio.run(run_async(address))
    else:
        run_threads(address)
