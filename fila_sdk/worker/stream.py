"""The worker's `StreamConsume` stream across its ends: open, read, open again.

Deliveries go to the engine's buffer (`deliver`); when a stream ends, what it
delivered and the engine had not started is the broker's again (`lost`). Broker
restarts: the stream is opened again with backoff (`fila_sdk.retry`); handlers that
were running finish and are settled by unary call (`fila_sdk.worker.settlement`).
Cluster mode: the stream is opened on the queue's node, wherever the client was
pointed (`fila_sdk.subscription`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

import grpc

from .._channel import interrupted, map_rpc_error
from ..aio import AsyncClient
from ..errors import ClientClosedError, FilaError, MessageNotFoundError, RPCError, UnavailableError
from ..retry import Reconnector, async_probe, retryable
from ..streams import method_missing
from ..subscription import Subscription
from ..types import Message
from .options import Options, WorkerStats
from .settlement import Session, Settlement

log = logging.getLogger("fila_sdk")

# How long a stopping worker waits for the broker to end the stream it half-closed.
_CLOSE_TIMEOUT_S: Final = 5.0


class Stream:
    """Reads the stream until the worker stops (see the module docstring). It alone
    sets and clears `connected`: set while a stream is open (or about to be)."""

    def __init__(
        self,
        client: AsyncClient,
        options: Options,
        settlement: Settlement,
        deliver: Callable[[list[Message]], None],
        lost: Callable[[], None],
        stopping: asyncio.Event,
        connected: asyncio.Event,
        stats: WorkerStats,
    ) -> None:
        self._client = client
        self._options = options
        self._settlement = settlement
        self._deliver = deliver
        self._lost = lost
        self._stopping = stopping
        self._stats = stats
        self.connected = connected
        connected.set()

    async def read(self) -> None:
        """Serves until the worker stops; raises what ends it otherwise
        (`BrokerUnreachableError`, `QueueNotFoundError`, `ClientClosedError`, ...)."""
        client, options = self._client, self._options
        what = f"worker on {options.queue!r}"
        subscription = Subscription(what, client._leaders, Reconnector.of(what, client.settings))
        probe = async_probe(client._channel)
        from_proto = Message.from_proto
        deliver = self._deliver
        while True:
            # On the queue's owner while following one, else round-robin, as ever.
            session = Session(client, options, subscription.owner)
            self._settlement.attach(session)
            writer = asyncio.get_running_loop().create_task(session.write())
            error: FilaError | None = None
            redirected = False
            try:
                async for frame in session.call:
                    messages = subscription.messages(frame)
                    if messages:
                        deliver([from_proto(m) for m in messages])
            except grpc.RpcError as err:
                self._settlement.detach()  # (see below) before `_stream_error` awaits
                redirected = subscription.redirected(err)
                if not redirected:
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
                self._settlement.detach()
                self._lost()
                self.connected.clear()
                writer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await writer
            if self._stopping.is_set():
                return
            if client.closed:
                raise ClientClosedError("the client was closed under a running worker")
            if redirected:  # the queue's owner is elsewhere: open the stream there now
                self.connected.set()
                continue
            if error is None:
                error = UnavailableError("the broker ended the stream", grpc.StatusCode.UNAVAILABLE)
            if isinstance(error, MessageNotFoundError):
                # A settlement named a lease this stream no longer held (it expired):
                # the broker ended the stream and took its leases back.
                log.warning("worker on %r: %s; resubscribing", options.queue, error)
            elif not retryable(error):
                raise error
            self._stats.resubscribed += 1
            reconnector = subscription.reconnector
            stops = (self._stopping, client._closing_event())
            reached = await reconnector.wait_async(error, probe, *stops)
            if not reached and not self._stopping.is_set():  # closed: say so, as above
                raise ClientClosedError("the client was closed under a running worker")
            self.connected.set()  # (a stopping worker's drain ends the stream it opens)

    async def finish(self, reader: asyncio.Task[None]) -> None:
        """Half-closes the open stream once its settlements are written, so that the
        broker takes back the rest at once, and waits (a while) for `reader` to end."""
        session = self._settlement.session
        if session is None:
            return
        session.finish()
        _, pending = await asyncio.wait((reader,), timeout=_CLOSE_TIMEOUT_S)
        if pending:
            session.call.cancel()

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
