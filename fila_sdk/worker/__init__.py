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

The package by concern: `engine` (the buffer, the slots, one run), `stream` (the
`StreamConsume` stream across its ends), `settlement` (acks and nacks on the stream
or by unary call), `leases` (what is held, and the heartbeat extending it), `faces`
(`Worker`, `AsyncWorker`, `ThreadWorker`), with `options`, `handlers` and `signals`.
"""

from .faces import AsyncWorker, ThreadWorker, Worker
from .handlers import AsyncHandler, SyncHandler
from .options import WorkerStats

__all__ = ["AsyncHandler", "AsyncWorker", "SyncHandler", "ThreadWorker", "Worker", "WorkerStats"]
