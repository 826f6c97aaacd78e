"""asyncio client over `grpc.aio`; same methods as `Client`, awaited.

The hot path rides the batch paths of SPEC 1 wherever the caller allows it:
`enqueue` over an open `StreamEnqueue` stream with concurrent calls coalesced
(`fila_sdk.streams`), `ack` and `nack` coalesced into `AckBatch` / `NackBatch`
(`fila_sdk.batching`), `enqueue_many` / `ack_many` / `nack_many` as chunked batch
calls, `consume(prefetch=, max_batch=)` with several messages per frame. Against a
broker without those RPCs (`UNIMPLEMENTED`) each falls back to the unary calls for
good. `consume` survives broker restarts (`fila_sdk.retry`) and, in a cluster, opens
its stream on the queue's node (`fila_sdk.leader`).
"""

from __future__ import annotations

import asyncio
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Self, TypeVar, overload

import grpc
import grpc.aio
from google.protobuf.message import Message as ProtoMessage

from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

from ._channel import (
    MAX_PEEK_LIMIT,
    ChannelOptions,
    Settings,
    create_api_key_request,
    map_rpc_error,
    milliseconds,
    peek_request,
    queue_config,
    set_acl_request,
    update_queue_request,
)
from .arguments import UNSET, Payload, enqueue_arguments, json_arguments
from .batching import (
    PIPELINE_DEPTH,
    Coalescer,
    EnqueueLike,
    NackItem,
    ack_batch_request,
    bounded_error,
    chunks,
    enqueue_batch_request,
    enqueue_results,
    entries,
    entry_bytes,
    nack_batch_request,
    settle_results,
)
from .errors import (
    ClientClosedError,
    DeadlineExceededError,
    FilaError,
    QueueAlreadyExistsError,
    UnavailableError,
)
from .leader import AsyncLeaders, Follower
from .retry import Reconnector, async_probe, retryable
from .streams import Producer
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

    `timeout` bounds every call (`DeadlineExceededError`), except `consume`, whose
    stream lives as long as the caller reads it. `reconnect_timeout` is how long a
    consumer keeps trying to get back to a broker it lost (None: forever) before it
    raises `BrokerUnreachableError`. `connections` > 1 opens that many TCP
    connections and spreads enqueue streams and batch calls over them round-robin;
    `channel_options` are extra gRPC channel arguments, applied last.
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
        self._batch_settlement = True  # False once the broker answered UNIMPLEMENTED
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
        return self._settings

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self) -> None:
        """Close the connections; open `consume` iterators end quietly, and calls still
        waiting for an answer raise `ClientClosedError`."""
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
        """Wait until the broker accepts a connection; see `Client.wait_ready`."""
        self._check_open()
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            raise UnavailableError(
                f"cannot reach broker at {self._settings.target} within {timeout:g}s",
                grpc.StatusCode.UNAVAILABLE,
            ) from None

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
            if self._closed:
                raise ClientClosedError() from err
            raise map_rpc_error(err, type(request).__name__.removesuffix("Request")) from err

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
        """Store one message and return its id once it is durable.

        `enqueue(queue, payload, headers=...)`, or the published order
        `enqueue(queue, headers, payload)`; a `str` payload is sent as UTF-8 (see
        `fila_sdk.arguments`). Concurrent calls (from many tasks) travel together in
        one request on an open `StreamEnqueue` stream; each still gets its own id or
        exception. `delay` (a `timedelta` or seconds) makes the message ready only
        that long after.
        """
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
        """`enqueue` of `value` as JSON, with `content-type: application/json` (unless
        `headers` name a content type); read it back with `Message.json()`."""
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
        """Store many messages in few `EnqueueBatch` calls; one result per item, in order:
        its message id, or the `FilaError` that item alone failed with (a call that
        failed as a whole fails each of its items). Never raises for an item.

        An item is an `EnqueueItem`, bare payload bytes, or a (headers, payload) or
        (headers, payload, delay) tuple."""
        self._check_open()
        batch = entries(items)
        spans = list(chunks([entry_bytes(e) for e in batch]))
        results: list[str | FilaError] = []
        gate = asyncio.Semaphore(PIPELINE_DEPTH)

        async def send(span: range) -> list[str | FilaError]:
            async with gate:
                request = enqueue_batch_request(queue, batch, span)
                try:
                    response = await self._unary(self._next_service().EnqueueBatch, request)
                except FilaError as exc:
                    return [exc] * len(span)
                return enqueue_results(response.results)

        for part in await asyncio.gather(*(send(span) for span in spans)):
            results += part
        return results

    def consume(
        self, queue: str, *, prefetch: int | None = None, max_batch: int | None = None
    ) -> AsyncGenerator[Message, None]:
        """Yield messages as the broker leases them, one at a time; see `Client.consume`.

        Wrap in `contextlib.aclosing` to cancel the stream at a deterministic point
        rather than when the abandoned generator is collected.
        """
        self._check_open()
        request = service_pb2.ConsumeRequest(
            queue=queue,
            prefetch=_count(prefetch, "prefetch"),
            max_batch=_count(max_batch, "max_batch"),
        )
        return self._consume(request)

    async def _consume(self, request: service_pb2.ConsumeRequest) -> AsyncGenerator[Message, None]:
        reconnector = Reconnector(
            f"consumer of {request.queue!r}",
            self._settings.target,
            self._settings.reconnect_timeout,
        )
        follower = Follower(self._leaders, f"consumer of {request.queue!r}")  # cluster mode
        from_proto = Message.from_proto
        while True:
            call = follower.service.Consume(request, metadata=self._settings.metadata)
            error: FilaError
            try:
                async for response in call:
                    if reconnector.backing_off:
                        reconnector.delivered()
                    if follower.hops:
                        follower.delivered()
                    batch = response.messages
                    if batch:
                        for message in batch:
                            yield from_proto(message)
                    elif response.HasField("message"):  # else a keepalive frame
                        yield from_proto(response.message)
                return  # the server ended the stream (Fila never does; a foreign server may)
            except grpc.RpcError as err:
                if self._closed:
                    return
                if follower.follow(err):  # the queue's owner is elsewhere: consume there
                    continue
                follower.lost()
                error = map_rpc_error(err, "Consume")
                if not retryable(error):
                    raise error from err
            except asyncio.CancelledError:
                # grpc.aio reports a call cancelled by close() as CancelledError; swallow
                # only that one, never a cancellation of the consuming task itself.
                task = asyncio.current_task()
                if self._closed and task is not None and not task.cancelling():
                    return
                raise
            finally:
                call.cancel()
            if not await self._reconnect(reconnector, error):
                return

    async def _reconnect(self, reconnector: Reconnector, error: FilaError) -> bool:
        """Waits until the broker can be reached again; False if the client closed."""
        if self._closed:
            return False
        closing = asyncio.ensure_future(self._closing_event().wait())
        waiting = asyncio.ensure_future(reconnector.wait_async(error, self._probe))
        try:
            await asyncio.wait((closing, waiting), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (closing, waiting):
                task.cancel()
            await asyncio.gather(closing, waiting, return_exceptions=True)
        if self._closed:
            return False
        waiting.result()  # raises BrokerUnreachableError when it gave up
        return True

    def _closing_event(self) -> asyncio.Event:
        """Set by `close`: what waits for the broker waits for this too."""
        if self._closing is None:
            self._closing = asyncio.Event()
        return self._closing

    async def ack(self, queue: str, message_id: str) -> None:
        """Ack one message. Acks made in the same turn of the event loop (by many
        tasks) travel in one `AckBatch` call; none waits for a timer."""
        acks = self._acks
        if acks is None:
            self._check_open()
            acks = self._acks = Coalescer(self._send_acks)
        await self._bounded(acks.submit((queue, message_id)))

    async def nack(self, queue: str, message_id: str, error: str = "") -> None:
        """Nack one message (coalesced like `ack`, into `NackBatch`)."""
        nacks = self._nacks
        if nacks is None:
            self._check_open()
            nacks = self._nacks = Coalescer(self._send_nacks)
        await self._bounded(nacks.submit((queue, message_id, bounded_error(error))))

    async def ack_many(self, queue: str, message_ids: Iterable[str]) -> list[FilaError | None]:
        """Ack many messages in few `AckBatch` calls; per item None (acked) or its error."""
        ids = list(message_ids)
        return await self._settle_many(
            "Ack", len(ids), lambda span: ack_batch_request(queue, ids, span)
        )

    async def nack_many(
        self, queue: str, items: Iterable[NackItem], error: str = ""
    ) -> list[FilaError | None]:
        """Nack many messages in few `NackBatch` calls. An item is a message id (nacked
        with `error`) or a (message id, error) pair; per item None or its error."""
        listed = list(items)
        return await self._settle_many(
            "Nack", len(listed), lambda span: nack_batch_request(queue, listed, error, span)
        )

    async def extend_lease(
        self, queue: str, message_id: str, extend: timedelta | float | None = None
    ) -> datetime:
        """Push a leased message's deadline to now + `extend` (a `timedelta` or seconds;
        None: the queue's visibility timeout); returns the new deadline."""
        request = service_pb2.ExtendLeaseRequest(
            queue=queue, message_id=message_id, extend_ms=milliseconds(extend, "extend")
        )
        response = await self._unary(self._next_service().ExtendLease, request)
        return response.deadline.ToDatetime(tzinfo=UTC)

    async def _send_acks(self, items: list[tuple[str, str]]) -> Sequence[FilaError | None]:
        if self._batch_settlement:
            request = service_pb2.AckBatchRequest()
            add = request.acks.add
            for queue, message_id in items:
                add(queue=queue, message_id=message_id)
            outcome = await self._settle_batch("Ack", request)
            if outcome is not None:
                return outcome
        ack = self._next_service().Ack
        return await asyncio.gather(
            *(self._settled(ack, service_pb2.AckRequest(queue=q, message_id=m)) for q, m in items)
        )

    async def _send_nacks(self, items: list[tuple[str, str, str]]) -> Sequence[FilaError | None]:
        if self._batch_settlement:
            request = service_pb2.NackBatchRequest()
            add = request.nacks.add
            for queue, message_id, error in items:
                add(queue=queue, message_id=message_id, error=error)
            outcome = await self._settle_batch("Nack", request)
            if outcome is not None:
                return outcome
        nack = self._next_service().Nack
        return await asyncio.gather(
            *(
                self._settled(nack, service_pb2.NackRequest(queue=q, message_id=m, error=e))
                for q, m, e in items
            )
        )

    async def _settle_batch(
        self, rpc: str, request: service_pb2.AckBatchRequest | service_pb2.NackBatchRequest
    ) -> list[FilaError | None] | None:
        """One AckBatch / NackBatch; None if the broker does not have them (fall back)."""
        self._check_open()
        service = self._next_service()
        timeout, metadata = self._settings.timeout, self._settings.metadata
        response: service_pb2.AckBatchResponse | service_pb2.NackBatchResponse
        try:
            if isinstance(request, service_pb2.AckBatchRequest):
                response = await service.AckBatch(request, timeout=timeout, metadata=metadata)
            else:
                response = await service.NackBatch(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._batch_settlement = False
                return None
            if self._closed:
                raise ClientClosedError() from err
            raise map_rpc_error(err, f"{rpc}Batch") from err
        return settle_results(response.results, rpc)

    async def _settled(
        self, rpc: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req
    ) -> FilaError | None:
        try:
            await self._unary(rpc, request)
        except FilaError as exc:
            return exc
        return None

    async def _settle_many(
        self,
        rpc: str,
        count: int,
        build: Callable[[range], service_pb2.AckBatchRequest | service_pb2.NackBatchRequest],
    ) -> list[FilaError | None]:
        self._check_open()
        results: list[FilaError | None] = []
        for span in chunks([0] * count):
            request = build(span)
            try:
                outcome = await self._settle_batch(rpc, request)
            except FilaError as exc:
                outcome = [exc] * len(span)
            if outcome is None:  # no batch RPCs: one unary call per item
                outcome = list(await self._unary_settlements(rpc, request))
            results += outcome
        return results

    async def _unary_settlements(
        self, rpc: str, request: service_pb2.AckBatchRequest | service_pb2.NackBatchRequest
    ) -> Sequence[FilaError | None]:
        if isinstance(request, service_pb2.AckBatchRequest):
            return await self._send_acks([(a.queue, a.message_id) for a in request.acks])
        return await self._send_nacks([(n.queue, n.message_id, n.error) for n in request.nacks])

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
        """Create queue `name` (and `name.dlq`); returns its id (the name).

        With `exist_ok`, a queue of that name already existing is success, so setup
        code can run on every start; the existing queue keeps its own hooks and
        timeout (they are not compared with these).
        """
        config = queue_config(
            on_enqueue, on_failure, visibility_timeout_ms, max_attempts, retry_backoff
        )
        request = admin_pb2.CreateQueueRequest(name=name, config=config)
        try:
            return (await self._unary(self._admin.CreateQueue, request)).queue_id
        except QueueAlreadyExistsError:
            if not exist_ok:
                raise
            return name

    async def delete_queue(self, name: str) -> None:
        await self._unary(self._admin.DeleteQueue, admin_pb2.DeleteQueueRequest(queue=name))

    async def get_queue(self, name: str) -> QueueDetails:
        """The queue's configuration in force and its dead-letter queue."""
        request = admin_pb2.GetQueueRequest(queue=name)
        return QueueDetails.from_proto(await self._unary(self._admin.GetQueue, request))

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
        """Change the given settings of queue `name` (None: unchanged; "" clears a
        script; `max_attempts=UNLIMITED_ATTEMPTS` lifts the limit); returns the
        configuration in force. Scripts are checked before anything changes; messages
        enqueued after this returns see the new configuration."""
        request = update_queue_request(
            name, on_enqueue, on_failure, visibility_timeout_ms, max_attempts, retry_backoff
        )
        response = await self._unary(self._admin.UpdateQueue, request)
        return QueueConfig.from_proto(response.config)

    async def list_queues(self) -> list[QueueInfo]:
        response = await self._unary(self._admin.ListQueues, admin_pb2.ListQueuesRequest())
        return [QueueInfo.from_proto(q) for q in response.queues]

    async def get_stats(self, queue: str) -> QueueStats:
        request = admin_pb2.GetStatsRequest(queue=queue)
        return QueueStats.from_proto(await self._unary(self._admin.GetStats, request))

    async def set_config(self, key: str, value: str) -> None:
        await self._unary(self._admin.SetConfig, admin_pb2.SetConfigRequest(key=key, value=value))

    async def get_config(self, key: str) -> str:
        request = admin_pb2.GetConfigRequest(key=key)
        return (await self._unary(self._admin.GetConfig, request)).value

    async def list_config(self, prefix: str = "") -> ConfigListing:
        request = admin_pb2.ListConfigRequest(prefix=prefix)
        return ConfigListing.from_proto(await self._unary(self._admin.ListConfig, request))

    async def redrive(self, dlq_queue: str, count: int = 0) -> int:
        request = admin_pb2.RedriveRequest(dlq_queue=dlq_queue, count=count)
        return (await self._unary(self._admin.Redrive, request)).redriven

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
        request = peek_request(queue, limit, after_id, fairness_key, state)
        return PeekPage.from_proto(await self._unary(self._admin.PeekMessages, request))

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
        request = admin_pb2.PurgeQueueRequest(queue=queue)
        return (await self._unary(self._admin.PurgeQueue, request)).purged

    # API keys and ACLs (superadmins manage keys; see the broker's docs/semantics.md).

    async def create_api_key(
        self, name: str, *, superadmin: bool = False, expires_at: datetime | None = None
    ) -> CreatedApiKey:
        """Create a key; the returned `key` is the only copy of the secret."""
        request = create_api_key_request(name, superadmin, expires_at)
        response = await self._unary(self._admin.CreateApiKey, request)
        return CreatedApiKey(response.key_id, response.key, response.is_superadmin)

    async def list_api_keys(self) -> list[ApiKeyInfo]:
        response = await self._unary(self._admin.ListApiKeys, admin_pb2.ListApiKeysRequest())
        return [ApiKeyInfo.from_proto(k) for k in response.keys]

    async def revoke_api_key(self, key_id: str) -> None:
        request = admin_pb2.RevokeApiKeyRequest(key_id=key_id)
        await self._unary(self._admin.RevokeApiKey, request)

    async def set_acl(self, key_id: str, permissions: Iterable[AclPermission | str]) -> None:
        """Replace the key's permissions; strings are "kind:pattern"."""
        await self._unary(self._admin.SetAcl, set_acl_request(key_id, permissions))

    async def get_acl(self, key_id: str) -> Acl:
        request = admin_pb2.GetAclRequest(key_id=key_id)
        return Acl.from_proto(await self._unary(self._admin.GetAcl, request))


def _count(value: int | None, what: str) -> int:
    """An optional positive count for the wire (0 = the broker's default)."""
    if value is None:
        return 0
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    return value
