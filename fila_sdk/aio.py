"""asyncio client over `grpc.aio`; the methods of `Client`, awaited.

The requests and the records their answers become are built in `fila_sdk._calls`,
shared with `Client`. The hot path rides the batch paths of SPEC 1 wherever the
caller allows it: `enqueue` over an open `StreamEnqueue` stream with concurrent calls
coalesced (`fila_sdk.streams`), `ack` and `nack` coalesced into `AckBatch` /
`NackBatch` (`fila_sdk.batching`), `enqueue_many` / `ack_many` / `nack_many` as chunked
batch calls, `consume(prefetch=, max_batch=)` with several messages per frame.
Against a broker without those RPCs (`UNIMPLEMENTED`) each falls back to the unary
calls for good. `consume` survives broker restarts (`fila_sdk.retry`) and, in a
cluster, opens its stream on the queue's node (`fila_sdk.leader`).
"""

from __future__ import annotations

import asyncio
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Self, TypeVar, overload

import grpc
import grpc.aio
from google.protobuf.message import Message as ProtoMessage

from fila.v1 import admin_pb2_grpc, service_pb2, service_pb2_grpc

from . import _calls as calls
from ._calls import MAX_PEEK_LIMIT, BatchSettlement, Call
from ._channel import ChannelOptions, Settings, call_error, milliseconds, not_ready
from .arguments import UNSET, Payload, enqueue_arguments, json_arguments
from .batching import PIPELINE_DEPTH, Coalescer, EnqueueLike, NackItem, bounded_error
from .errors import ClientClosedError, DeadlineExceededError, FilaError
from .leader import AsyncLeaders
from .retry import Reconnector, async_probe
from .streams import Producer
from .subscription import Subscription
from .types import (
    Acl,
    AclPermission,
    ApiKeyInfo,
    ConfigListing,
    CreatedApiKey,
    Message,
    PeekPage,
    QueueConfig,
    QueueDetails,
    QueueInfo,
    QueueStats,
)

_Req = TypeVar("_Req", bound=ProtoMessage)
_Resp = TypeVar("_Resp", bound=ProtoMessage)
_T = TypeVar("_T")


class AsyncClient:
    """A connection (or `connections` of them) to one broker, for use on one event loop.

    Takes the arguments of `Client`, and raises what it raises. Use it as
    `async with AsyncClient(addr) as client:` or call `close()`.
    """

    def __init__(
        self,
        addr: str = "localhost:5555",
        *,
        tls: bool = False,
        ca_cert: bytes | None = None,
        client_cert: bytes | None = None,
        client_key: bytes | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
        channel_options: ChannelOptions | None = None,
        connections: int = 1,
        reconnect_timeout: float | None = 30.0,
    ) -> None:
        self._open(
            Settings.build(
                addr,
                tls=tls,
                ca_cert=ca_cert,
                client_cert=client_cert,
                client_key=client_key,
                api_key=api_key,
                timeout=timeout,
                channel_options=channel_options,
                connections=connections,
                reconnect_timeout=reconnect_timeout,
            )
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> AsyncClient:
        """A client with the settings of another (the blocking `Client` runs one on its
        own loop for its streams). Call it on the loop that will use the client."""
        client = cls.__new__(cls)
        client._open(settings)
        return client

    def _open(self, settings: Settings) -> None:
        self._settings = settings
        self._channels = [settings.aio_channel() for _ in range(settings.connections)]
        self._channel = self._channels[0]
        self._services: list[service_pb2_grpc.FilaServiceAsyncStub] = [
            service_pb2_grpc.FilaServiceStub(c) for c in self._channels
        ]
        self._service = self._services[0]
        self._leaders = AsyncLeaders(settings, self._service)  # cluster mode's owners
        self._admin = admin_pb2_grpc.FilaAdminStub(self._channel)
        self._turn = 0
        self._closed = False
        self._closing: asyncio.Event | None = None
        # Created on first use, on the loop that uses them.
        self._producer: Producer | None = None
        self._acks: Coalescer[tuple[str, str], None] | None = None
        self._nacks: Coalescer[tuple[str, str, str], None] | None = None
        self._batches = BatchSettlement()
        self._probe = async_probe(self._channel)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def settings(self) -> Settings:
        """The validated connection settings (`settings.target` is the address)."""
        return self._settings

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    async def close(self) -> None:
        """Close the connections; open `consume` iterators end quietly, and calls still
        waiting for an answer raise `ClientClosedError`. Closing twice does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._closing is not None:
            self._closing.set()
        if self._producer is not None:
            await self._producer.aclose()
        for coalescer in (self._acks, self._nacks):
            if coalescer is not None:
                await coalescer.aclose()
        for channel in self._channels:
            await channel.close(None)
        await self._leaders.close()

    async def wait_ready(self, timeout: float) -> None:  # noqa: ASYNC109 (mirrors Client)
        """Wait until the broker accepts a connection; raises `UnavailableError` if it
        does not within `timeout` seconds (see `Client.wait_ready`)."""
        self._check_open()
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            raise not_ready(self._settings.target, timeout) from None

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError()

    def _next_service(self) -> service_pb2_grpc.FilaServiceAsyncStub:
        """The hot-path stub of the next connection, round-robin."""
        services = self._services
        if len(services) == 1:
            return services[0]
        self._turn = (self._turn + 1) % len(services)
        return services[self._turn]

    async def _unary(
        self, rpc: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req
    ) -> _Resp:
        self._check_open()
        try:
            return await rpc(
                request, timeout=self._settings.timeout, metadata=self._settings.metadata
            )
        except grpc.RpcError as err:
            method = type(request).__name__.removesuffix("Request")
            raise call_error(err, method, self._closed) from err

    async def _call(self, call: Call[Any, _T]) -> _T:
        """Makes `call` and returns what its answer becomes."""
        stub = self._admin if call.admin else self._next_service()
        try:
            response = await self._unary(getattr(stub, call.method), call.request)
        except FilaError as error:
            return call.failed(error)
        return call.answer(response)

    async def _outcome(self, call: Call[Any, None]) -> FilaError | None:
        """None if `call` succeeded, else its error."""
        try:
            await self._call(call)
        except FilaError as error:
            return error
        return None

    async def _bounded(self, waiter: Awaitable[_T]) -> _T:
        """Waits for a coalesced call's answer within the client's `timeout`."""
        timeout = self._settings.timeout
        if timeout is None:
            return await waiter
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            raise DeadlineExceededError(
                f"no answer within the client timeout of {timeout:g}s",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from None

    # Hot path.

    @overload
    async def enqueue(
        self,
        queue: str,
        payload: Payload,
        /,
        *,
        headers: Mapping[str, str] | None = None,
        delay: timedelta | float | None = None,
    ) -> str: ...

    @overload
    async def enqueue(
        self,
        queue: str,
        headers: Mapping[str, str] | None,
        payload: Payload,
        /,
        *,
        delay: timedelta | float | None = None,
    ) -> str: ...

    @overload
    async def enqueue(
        self,
        queue: str,
        *,
        payload: Payload,
        headers: Mapping[str, str] | None = None,
        delay: timedelta | float | None = None,
    ) -> str: ...

    async def enqueue(
        self,
        queue: str,
        *args: Any,
        headers: Any = UNSET,
        payload: Any = UNSET,
        delay: timedelta | float | None = None,
    ) -> str:
        """Store one message and return its id once it is durable; arguments and
        errors as `Client.enqueue`. Concurrent calls (from many tasks) travel together
        in one request on an open `StreamEnqueue` stream."""
        checked, body = enqueue_arguments(args, headers, payload)
        return await self._enqueue(queue, checked, body, delay)

    async def enqueue_json(
        self,
        queue: str,
        value: object,
        *,
        headers: Mapping[str, str] | None = None,
        delay: timedelta | float | None = None,
    ) -> str:
        """`enqueue` of `value` as JSON; see `Client.enqueue_json`."""
        checked, body = json_arguments(value, headers)
        return await self._enqueue(queue, checked, body, delay)

    async def _enqueue(
        self,
        queue: str,
        headers: Mapping[str, str] | None,
        payload: bytes,
        delay: timedelta | float | None,
    ) -> str:
        producer = self._producer
        if producer is None:
            self._check_open()
            producer = self._producer = Producer(self._services, self._settings.metadata)
        delay_ms = 0 if delay is None else milliseconds(delay, "delay")
        return await self._bounded(producer.enqueue(queue, headers, payload, delay_ms))

    async def enqueue_many(self, queue: str, items: Iterable[EnqueueLike]) -> list[str | FilaError]:
        """Store many messages in few `EnqueueBatch` calls, a few in flight at once; one
        result per item, as `Client.enqueue_many`."""
        self._check_open()
        gate = asyncio.Semaphore(PIPELINE_DEPTH)

        async def send(call: Call[Any, list[str | FilaError]]) -> list[str | FilaError]:
            async with gate:
                return await self._call(call)

        parts = await asyncio.gather(*(send(c) for c in calls.enqueue_batches(queue, items)))
        return [result for part in parts for result in part]

    def consume(
        self, queue: str, *, prefetch: int | None = None, max_batch: int | None = None
    ) -> AsyncGenerator[Message, None]:
        """Yield messages as the broker leases them, one at a time; see `Client.consume`.

        Wrap in `contextlib.aclosing` to cancel the stream at a deterministic point
        rather than when the abandoned generator is collected.
        """
        self._check_open()
        return self._consume(calls.consume_request(queue, prefetch, max_batch))

    async def _consume(self, request: service_pb2.ConsumeRequest) -> AsyncGenerator[Message, None]:
        what = f"consumer of {request.queue!r}"
        subscription = Subscription(what, self._leaders, Reconnector.of(what, self._settings))
        from_proto = Message.from_proto
        while True:
            call = subscription.service.Consume(request, metadata=self._settings.metadata)
            error: FilaError
            try:
                async for frame in call:
                    for message in subscription.messages(frame):
                        yield from_proto(message)
                return  # the server ended the stream (Fila never does; a foreign server may)
            except grpc.RpcError as err:
                if self._closed:
                    return
                if subscription.redirected(err):  # the queue's owner is elsewhere
                    continue
                error = subscription.failed(err, "Consume")
            except asyncio.CancelledError:
                # grpc.aio reports a call cancelled by close() as CancelledError; swallow
                # only that one, never a cancellation of the consuming task itself.
                task = asyncio.current_task()
                if self._closed and task is not None and not task.cancelling():
                    return
                raise
            finally:
                call.cancel()
            reconnector = subscription.reconnector
            if self._closed or not await reconnector.wait_async(
                error, self._probe, self._closing_event()
            ):
                return

    def _closing_event(self) -> asyncio.Event:
        """Set by `close`: what waits for the broker waits for this too."""
        if self._closing is None:
            self._closing = asyncio.Event()
        return self._closing

    async def ack(self, queue: str, message_id: str) -> None:
        """Acknowledge a leased message; see `Client.ack`. Acks made in the same turn of
        the event loop (by many tasks) travel in one `AckBatch` call; none waits for a
        timer."""
        acks = self._acks
        if acks is None:
            self._check_open()
            acks = self._acks = Coalescer(self._send_acks)
        await self._bounded(acks.submit((queue, message_id)))

    async def nack(self, queue: str, message_id: str, error: str = "") -> None:
        """Report a leased message as failed; see `Client.nack`. Coalesced like `ack`,
        into `NackBatch`."""
        nacks = self._nacks
        if nacks is None:
            self._check_open()
            nacks = self._nacks = Coalescer(self._send_nacks)
        await self._bounded(nacks.submit((queue, message_id, bounded_error(error))))

    async def ack_many(self, queue: str, message_ids: Iterable[str]) -> list[FilaError | None]:
        """Ack many messages in few `AckBatch` calls; per item None (acked) or its error
        (see `Client.ack_many`)."""
        return await self._settle_many(calls.ack_batches(queue, message_ids))

    async def nack_many(
        self, queue: str, items: Iterable[NackItem], error: str = ""
    ) -> list[FilaError | None]:
        """Nack many messages in few `NackBatch` calls; per item None or its error (see
        `Client.nack_many`)."""
        return await self._settle_many(calls.nack_batches(queue, items, error))

    async def extend_lease(
        self, queue: str, message_id: str, extend: timedelta | float | None = None
    ) -> datetime:
        """Push a leased message's deadline to now + `extend`; returns the new deadline
        (see `Client.extend_lease`)."""
        return await self._call(calls.extend_lease(queue, message_id, extend))

    async def _send_acks(self, items: list[tuple[str, str]]) -> Sequence[FilaError | None]:
        return await self._settle(calls.ack_batch(items))

    async def _send_nacks(self, items: list[tuple[str, str, str]]) -> Sequence[FilaError | None]:
        return await self._settle(calls.nack_batch(items))

    async def _settle_many(
        self, requests: Iterator[service_pb2.AckBatchRequest | service_pb2.NackBatchRequest]
    ) -> list[FilaError | None]:
        self._check_open()
        return [outcome for request in requests for outcome in await self._settle(request)]

    async def _settle(
        self, request: service_pb2.AckBatchRequest | service_pb2.NackBatchRequest
    ) -> list[FilaError | None]:
        """One AckBatch / NackBatch (unary calls against a broker without them); per item
        None or its error."""
        if self._batches.available:
            outcome = await self._call(self._batches.call(request))
            if outcome is not None:
                return outcome
        return list(await asyncio.gather(*map(self._outcome, calls.one_by_one(request))))

    # Admin.

    async def create_queue(
        self,
        name: str,
        *,
        on_enqueue: str | None = None,
        on_failure: str | None = None,
        visibility_timeout_ms: int | None = None,
        exist_ok: bool = False,
        max_attempts: int | None = None,
        retry_backoff: str | None = None,
    ) -> str:
        """Create queue `name` (and `name.dlq`); returns its id (the name). See
        `Client.create_queue`."""
        config = calls.queue_config(
            on_enqueue, on_failure, visibility_timeout_ms, max_attempts, retry_backoff
        )
        return await self._call(calls.create_queue(name, config, exist_ok))

    async def delete_queue(self, name: str) -> None:
        """Delete queue `name` with its messages; see `Client.delete_queue`."""
        await self._call(calls.delete_queue(name))

    async def get_queue(self, name: str) -> QueueDetails:
        """The queue's configuration in force; see `Client.get_queue`."""
        return await self._call(calls.get_queue(name))

    async def update_queue(
        self,
        name: str,
        *,
        on_enqueue: str | None = None,
        on_failure: str | None = None,
        visibility_timeout_ms: int | None = None,
        max_attempts: int | None = None,
        retry_backoff: str | None = None,
    ) -> QueueConfig:
        """Change the given settings of queue `name`; returns the configuration in force
        (see `Client.update_queue`)."""
        request = calls.update_queue_request(
            name, on_enqueue, on_failure, visibility_timeout_ms, max_attempts, retry_backoff
        )
        return await self._call(calls.update_queue(request))

    async def list_queues(self) -> list[QueueInfo]:
        """Every queue; see `Client.list_queues`."""
        return await self._call(calls.list_queues())

    async def get_stats(self, queue: str) -> QueueStats:
        """The queue's counters; see `Client.get_stats`."""
        return await self._call(calls.get_stats(queue))

    async def set_config(self, key: str, value: str) -> None:
        """Set (or with "" delete) a runtime configuration value; see
        `Client.set_config`."""
        await self._call(calls.set_config(key, value))

    async def get_config(self, key: str) -> str:
        """A runtime configuration value; see `Client.get_config`."""
        return await self._call(calls.get_config(key))

    async def list_config(self, prefix: str = "") -> ConfigListing:
        """The runtime configuration values under `prefix`; see `Client.list_config`."""
        return await self._call(calls.list_config(prefix))

    async def redrive(self, dlq_queue: str, count: int = 0) -> int:
        """Move dead letters back to their queue; returns how many (see
        `Client.redrive`)."""
        return await self._call(calls.redrive(dlq_queue, count))

    async def peek(
        self,
        queue: str,
        *,
        limit: int | None = None,
        after_id: str | None = None,
        fairness_key: str | None = None,
        state: str | None = None,
    ) -> PeekPage:
        """One page of `queue`'s messages without leasing them; see `Client.peek`."""
        return await self._call(calls.peek(queue, limit, after_id, fairness_key, state))

    async def peek_all(
        self,
        queue: str,
        *,
        after_id: str | None = None,
        fairness_key: str | None = None,
        page_size: int = MAX_PEEK_LIMIT,
        state: str | None = None,
    ) -> AsyncIterator[Message]:
        """Every message of `queue` in id order, page by page; see `Client.peek_all`."""
        after = after_id
        while True:
            page = await self.peek(
                queue, limit=page_size, after_id=after, fairness_key=fairness_key, state=state
            )
            for message in page.messages:
                yield message
            if page.next_after_id is None:
                return
            after = page.next_after_id

    async def purge(self, queue: str) -> int:
        """Delete `queue`'s ready and delayed messages; see `Client.purge`."""
        return await self._call(calls.purge(queue))

    # API keys and ACLs (superadmins manage keys; see the broker's docs/semantics.md).

    async def create_api_key(
        self, name: str, *, superadmin: bool = False, expires_at: datetime | None = None
    ) -> CreatedApiKey:
        """Create an API key; the returned `key` is the only copy of the secret (see
        `Client.create_api_key`)."""
        return await self._call(calls.create_api_key(name, superadmin, expires_at))

    async def list_api_keys(self) -> list[ApiKeyInfo]:
        """Every API key, without its secret."""
        return await self._call(calls.list_api_keys())

    async def revoke_api_key(self, key_id: str) -> None:
        """Revoke a key; see `Client.revoke_api_key`."""
        await self._call(calls.revoke_api_key(key_id))

    async def set_acl(self, key_id: str, permissions: Iterable[AclPermission | str]) -> None:
        """Replace the key's permissions; see `Client.set_acl`."""
        await self._call(calls.set_acl(key_id, permissions))

    async def get_acl(self, key_id: str) -> Acl:
        """The key's permissions; see `Client.get_acl`."""
        return await self._call(calls.get_acl(key_id))
