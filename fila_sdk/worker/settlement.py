"""Where a handled message's ack or nack goes: on the stream, or by unary batch call.

One `StreamConsume` stream carries deliveries in and settlements out. Settlements
made in one turn of the loop travel in one request with no reply (`Session`; the
broker makes them durable with its next group commit). A message whose stream ended
meanwhile, or whose lease was found gone, is an orphan: it is settled with
`AckBatch` / `NackBatch` instead (`Settlement`), since naming an id the stream no
longer holds would end the stream. After a crash the broker still holds those
leases when it is back, so orphans the broker could not take wait for it.
"""

from __future__ import annotations

import asyncio
import logging

from fila.v1 import service_pb2, service_pb2_grpc

from ..aio import AsyncClient
from ..batching import bounded_error
from ..errors import DeadlineExceededError, FilaError, MessageNotFoundError
from ..retry import retryable
from ..streams import CALL_ENDED
from .leases import Leases
from .options import Options, WorkerStats

log = logging.getLogger("fila_sdk")


class Session:
    """One `StreamConsume` call: the opening request, then settlements as they come,
    coalesced per turn of the loop."""

    def __init__(
        self,
        client: AsyncClient,
        options: Options,
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


class Settlement:
    """Settles each handled message once, on the open stream or by unary call."""

    def __init__(
        self,
        client: AsyncClient,
        options: Options,
        leases: Leases,
        connected: asyncio.Event,
        stats: WorkerStats,
    ) -> None:
        self._client = client
        self._queue = options.queue
        self._leases = leases
        self._connected = connected
        self._stats = stats
        self._session: Session | None = None
        self._acks: list[str] = []
        self._nacks: list[tuple[str, str]] = []
        self._wake = asyncio.Event()
        # Ids with a unary settlement waiting or in flight: never settled on a stream.
        self._unary_pending: set[str] = set()

    @property
    def session(self) -> Session | None:
        """The open stream's session, if one is open."""
        return self._session

    def attach(self, session: Session) -> None:
        """A stream opened: settlements of what it delivers go on it."""
        self._session = session

    def detach(self) -> None:
        """The stream ended: from now on nothing settles on it (nobody would apply it)."""
        self._session = None

    def settle(self, message_id: str, error: str | None) -> None:
        """The handler of `message_id` returned (`error` None: ack) or raised (nack)."""
        if error is None:
            self._stats.acked += 1
        else:
            self._stats.nacked += 1
        session = self._session
        on_stream = self._leases.end(message_id) and session is not None
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
        self._leases.orphans.pop(message_id, None)
        self._unary_pending.add(message_id)
        if error is None:
            self._acks.append(message_id)
        else:
            self._nacks.append((message_id, error))
        self._wake.set()

    @property
    def pending(self) -> bool:
        """Whether orphans wait for their unary settlement."""
        return bool(self._acks or self._nacks)

    async def run(self) -> None:
        """Settles orphans as they come, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not await self.flush():
                # The broker is away. After a crash it still holds these leases when it
                # is back, so settling them then spares a redelivery.
                await self._connected.wait()
                self._wake.set()

    async def flush(self) -> bool:
        """Settles orphans by unary batch calls; False if some must wait for the broker
        to be back (they are kept for the next flush)."""
        acks, nacks = self._acks, self._nacks
        self._acks, self._nacks = [], []
        settled = True
        if acks:
            outcomes = await self._client.ack_many(self._queue, acks)
            for message_id, outcome in zip(acks, outcomes, strict=True):
                if self._failed(outcome):
                    self._acks.append(message_id)
                    settled = False
                else:
                    self._unary_settled(message_id)
        if nacks:
            outcomes = await self._client.nack_many(self._queue, nacks)
            for item, outcome in zip(nacks, outcomes, strict=True):
                if self._failed(outcome):
                    self._nacks.append(item)
                    settled = False
                else:
                    self._unary_settled(item[0])
        return settled

    def _unary_settled(self, message_id: str) -> None:
        """A unary settlement is done. If the id was delivered again meanwhile, that
        settlement may have ended the new lease too: forget the new delivery's lease
        (its handler, if it runs, settles by unary call and meets NOT_FOUND)."""
        self._unary_pending.discard(message_id)
        self._leases.held.pop(message_id, None)

    def _failed(self, outcome: FilaError | None) -> bool:
        """True if the settlement should be tried again once the broker is back."""
        if outcome is None:
            return False
        if isinstance(outcome, MessageNotFoundError):
            # Its lease ended with the stream (a clean broker shutdown) or expired: the
            # message is ready again and will be delivered again.
            log.info("worker on %r: settled too late, redelivered: %s", self._queue, outcome)
            return False
        if retryable(outcome) or isinstance(outcome, DeadlineExceededError):
            return True
        log.warning("worker on %r: settlement failed: %s", self._queue, outcome)
        return False
