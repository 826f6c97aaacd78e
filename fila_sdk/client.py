"""Blocking client; safe to share between threads.

Unary and batch calls (`ack`, `enqueue_many`, admin, ...) run on a gRPC sync
channel in the calling thread. Streams need something reading them while callers
block, so `enqueue` (which rides an open `StreamEnqueue` stream) and `Worker` run
the `AsyncClient` machinery on a private event loop thread, started on first use
(see `fila_sdk._loop`): one implementation of the stream protocols, and calls
from many threads coalesce into the same requests. The cost is a second
connection to the broker for those streams, and a thread hand-off per `enqueue`
(tens of microseconds, against a round trip to the broker).

`consume` stays a plain server stream read in the caller's thread, outlives
broker restarts (see `fila_sdk.retry`) and, in a cluster, follows the queue to its
node (see `fila_sdk.leader`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar, overload

import grpc
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
from ._loop import LoopThread
from .aio import AsyncClient
from .arguments import UNSET, Payload, enqueue_arguments, json_arguments
from .batching import (
    PIPELINE_DEPTH,
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
from .errors import ClientClosedError, FilaError, QueueAlreadyExistsError, UnavailableError
from .leader import Follower, SyncLeaders
from .retry import Reconnector, retryable, sync_probe
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
if TYPE_CHECKING:
    _BatchFuture = grpc.CallFuture[service_pb2.EnqueueBatchResponse]  # a stub-only type


class Client:
    """A connection (or `connections` of them) to one broker; see `AsyncClient` for
    `timeout`, `reconnect_timeout`, `connections` and `channel_options`."""

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
        self._settings = Settings.build(
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
        self._channels = [self._settings.sync_channel() for _ in range(connections)]
        self._channel = self._channels[0]
        self._services = [service_pb2_grpc.FilaServiceStub(c) for c in self._channels]
        self._service = self._services[0]
        self._leaders = SyncLeaders(self._settings, self._service)  # cluster mode's owners
        self._admin = admin_pb2_grpc.FilaAdminStub(self._channel)
        self._turn = 0
        self._closed = False
        self._closed_event = threading.Event()
        self._lock = threading.Lock()
        self._loop: LoopThread | None = None
        self._twin: AsyncClient | None = None
        self._batch_settlement = True  # False once the broker answered UNIMPLEMENTED
        self._probe = sync_probe(self._channel)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the connections; open `consume` iterators end quietly, and calls still
        waiting for an answer raise `ClientClosedError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closed_event.set()
            loop, twin = self._loop, self._twin
        if loop is not None:
            if twin is not None:
                loop.run(twin.close())
            loop.stop()
        for channel in self._channels:
            channel.close()
        self._leaders.close()

    def wait_ready(self, timeout: float) -> None:
        """Block until the broker accepts a connection, so that callers (a CLI, a test,
        a deploy script) can fail fast with one clear error instead of on the first RPC.
        """
        self._check_open()
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(
                f"cannot reach broker at {self._settings.target} within {timeout:g}s",
                grpc.StatusCode.UNAVAILABLE,
            ) from None

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError()

    def _next_service(self) -> service_pb2_grpc.FilaServiceStub:
        """The hot-path stub of the next connection, round-robin."""
        services = self._services
        if len(services) == 1:
            return services[0]
        with self._lock:
            self._turn = (self._turn + 1) % len(services)
            return services[self._turn]

    def _unary(self, rpc: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        self._check_open()
        try:
            return rpc(request, timeout=self._settings.timeout, metadata=self._settings.metadata)
        except grpc.RpcError as err:
            if self._closed:
                raise ClientClosedError() from err
            raise map_rpc_error(err, type(request).__name__.removesuffix("Request")) from err
        except ValueError as err:  # grpc: "Cannot invoke RPC on closed channel!"
            if self._closed:
                raise ClientClosedError() from err
            raise

    def streams(self) -> tuple[LoopThread, AsyncClient]:
        """The private loop thread and the `AsyncClient` on it, started on first use
        (for `enqueue` and `Worker`)."""
        with self._lock:
            if self._closed:
                raise ClientClosedError()
            if self._loop is None or self._twin is None:
                loop = LoopThread(f"fila-sdk-{self._settings.target}")

                async def open_twin() -> AsyncClient:
                    return AsyncClient.from_settings(self._settings)

                self._twin = loop.run(open_twin())
                self._loop = loop
            return self._loop, self._twin

    # Hot path.

    @overload
    def enqueue(
        self,
        queue: str,
        payload: Payload,
        /,
        *,
        headers: Mapping[str, str] | None = None,
        delay: timedelta | float | None = None,
    ) -> str: ...

    @overload
    def enqueue(
        self,
        queue: str,
        headers: Mapping[str, str] | None,
        payload: Payload,
        /,
        *,
        delay: timedelta | float | None = None,
    ) -> str: ...

    @overload
    def enqueue(
        self,
        queue: str,
        *,
        payload: Payload,
        headers: Mapping[str, str] | None = None,
        delay: timedelta | float | None = None,
    ) -> str: ...

    def enqueue(
        self,
        queue: str,
        *args: Any,
        headers: Any = UNSET,
        payload: Any = UNSET,
        delay: timedelta | float | None = None,
    ) -> str:
        """Store one message and return its id once it is durable: `enqueue(queue,
        payload, headers=...)` or the published `enqueue(queue, headers, payload)`
        (see `AsyncClient.enqueue`; calls from many threads share requests)."""
        checked, body = enqueue_arguments(args, headers, payload)
        return self._enqueue(queue, checked, body, delay)

    def enqueue_json(
        self,
        queue: str,
        value: object,
        *,
        headers: Mapping[str, str] | None = None,
        delay: timedelta | float | None = None,
    ) -> str:
        """`enqueue` of `value` as JSON (see `AsyncClient.enqueue_json`)."""
        checked, body = json_arguments(value, headers)
        return self._enqueue(queue, checked, body, delay)

    def _enqueue(
        self,
        queue: str,
        headers: Mapping[str, str] | None,
        payload: bytes,
        delay: timedelta | float | None,
    ) -> str:
        loop, twin = self.streams()
        if loop.in_loop_thread:  # waiting here would block the loop that must answer
            raise RuntimeError("Client.enqueue cannot be called from the client's own loop")
        return loop.run(twin.enqueue(queue, headers, payload, delay=delay))

    def enqueue_many(self, queue: str, items: Iterable[EnqueueLike]) -> list[str | FilaError]:
        """Store many messages in few `EnqueueBatch` calls; see `AsyncClient.enqueue_many`."""
        self._check_open()
        batch = entries(items)
        results: list[str | FilaError] = []
        window: list[tuple[range, _BatchFuture | None]] = []

        def collect(span: range, future: _BatchFuture | None) -> None:
            try:
                if future is None:
                    raise ClientClosedError()
                response = future.result()
            except grpc.RpcError as err:
                error = ClientClosedError() if self._closed else map_rpc_error(err, "EnqueueBatch")
                results.extend([error] * len(span))
                return
            except ClientClosedError as err:
                results.extend([err] * len(span))
                return
            results.extend(enqueue_results(response.results))

        for span in chunks([entry_bytes(e) for e in batch]):
            request = enqueue_batch_request(queue, batch, span)
            call: _BatchFuture | None = None
            if not self._closed:
                call = self._next_service().EnqueueBatch.future(
                    request, timeout=self._settings.timeout, metadata=self._settings.metadata
                )
            window.append((span, call))
            if len(window) >= PIPELINE_DEPTH:
                collect(*window.pop(0))
        for span, call in window:
            collect(span, call)
        return results

    def consume(
        self, queue: str, *, prefetch: int | None = None, max_batch: int | None = None
    ) -> Generator[Message, None, None]:
        """Yield messages as the broker leases them; the stream opens on first `next()`.

        `prefetch` bounds the messages delivered and not yet settled (the broker's
        `scheduler.consumer_buffer` by default); `max_batch` > 1 lets the broker send up
        to that many per frame. Messages are still yielded one at a time.

        Leaving the loop, closing the generator or closing the client cancels the
        stream, so the broker stops leasing to this consumer at once. If the broker
        goes away, the stream is opened again once it is back (messages delivered and
        not acked stay leased to the lost stream until their visibility timeout);
        `BrokerUnreachableError` if it stays away for the client's `reconnect_timeout`.
        """
        self._check_open()
        request = service_pb2.ConsumeRequest(
            queue=queue,
            prefetch=_count(prefetch, "prefetch"),
            max_batch=_count(max_batch, "max_batch"),
        )
        return self._consume(request)

    def _consume(self, request: service_pb2.ConsumeRequest) -> Generator[Message, None, None]:
        reconnector = Reconnector(
            f"consumer of {request.queue!r}",
            self._settings.target,
            self._settings.reconnect_timeout,
        )
        follower = Follower(self._leaders, f"consumer of {request.queue!r}")  # cluster mode
        from_proto = Message.from_proto
        while True:
            try:
                call = follower.service.Consume(request, metadata=self._settings.metadata)
            except ValueError:  # the channel was closed meanwhile
                if self._closed:
                    return
                raise
            error: FilaError
            try:
                for response in call:
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
            finally:
                call.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves it untyped
            try:
                if self._closed or not reconnector.wait_sync(
                    error, self._probe, self._closed_event
                ):
                    return
            except ValueError:  # grpc: the channel was closed meanwhile
                if self._closed:
                    return
                raise

    def ack(self, queue: str, message_id: str) -> None:
        self._unary(
            self._next_service().Ack, service_pb2.AckRequest(queue=queue, message_id=message_id)
        )

    def nack(self, queue: str, message_id: str, error: str = "") -> None:
        request = service_pb2.NackRequest(
            queue=queue, message_id=message_id, error=bounded_error(error)
        )
        self._unary(self._next_service().Nack, request)

    def ack_many(self, queue: str, message_ids: Iterable[str]) -> list[FilaError | None]:
        """Ack many messages in few `AckBatch` calls; per item None (acked) or its error."""
        ids = list(message_ids)
        return self._settle_many("Ack", len(ids), lambda span: ack_batch_request(queue, ids, span))

    def nack_many(
        self, queue: str, items: Iterable[NackItem], error: str = ""
    ) -> list[FilaError | None]:
        """Nack many messages in few `NackBatch` calls; see `AsyncClient.nack_many`."""
        listed = list(items)
        return self._settle_many(
            "Nack", len(listed), lambda span: nack_batch_request(queue, listed, error, span)
        )

    def extend_lease(
        self, queue: str, message_id: str, extend: timedelta | float | None = None
    ) -> datetime:
        """Push a leased message's deadline to now + `extend` (a `timedelta` or seconds;
        None: the queue's visibility timeout); returns the new deadline."""
        request = service_pb2.ExtendLeaseRequest(
            queue=queue, message_id=message_id, extend_ms=milliseconds(extend, "extend")
        )
        response = self._unary(self._next_service().ExtendLease, request)
        return response.deadline.ToDatetime(tzinfo=UTC)

    def _settle_many(
        self,
        rpc: str,
        count: int,
        build: Callable[[range], service_pb2.AckBatchRequest | service_pb2.NackBatchRequest],
    ) -> list[FilaError | None]:
        results: list[FilaError | None] = []
        for span in chunks([0] * count):
            results += self._settle_batch(rpc, build(span))
        return results

    def _settle_batch(
        self, rpc: str, request: service_pb2.AckBatchRequest | service_pb2.NackBatchRequest
    ) -> list[FilaError | None]:
        """One AckBatch / NackBatch (unary calls against a broker without them); per item
        None or its error, and a call that failed as a whole fails each item."""
        self._check_open()
        service = self._next_service()
        items = request.acks if isinstance(request, service_pb2.AckBatchRequest) else request.nacks
        if self._batch_settlement:
            timeout, metadata = self._settings.timeout, self._settings.metadata
            response: service_pb2.AckBatchResponse | service_pb2.NackBatchResponse
            try:
                if isinstance(request, service_pb2.AckBatchRequest):
                    response = service.AckBatch(request, timeout=timeout, metadata=metadata)
                else:
                    response = service.NackBatch(request, timeout=timeout, metadata=metadata)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    error = ClientClosedError() if self._closed else map_rpc_error(err, rpc)
                    return [error] * len(items)
                self._batch_settlement = False
            else:
                return settle_results(response.results, rpc)
        return [self._settled(service, item) for item in items]

    def _settled(
        self,
        service: service_pb2_grpc.FilaServiceStub,
        item: service_pb2.AckRequest | service_pb2.NackRequest,
    ) -> FilaError | None:
        try:
            if isinstance(item, service_pb2.AckRequest):
                self._unary(service.Ack, item)
            else:
                self._unary(service.Nack, item)
        except FilaError as exc:
            return exc
        return None

    # Admin.

    def create_queue(
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
            return self._unary(self._admin.CreateQueue, request).queue_id
        except QueueAlreadyExistsError:
            if not exist_ok:
                raise
            return name

    def delete_queue(self, name: str) -> None:
        self._unary(self._admin.DeleteQueue, admin_pb2.DeleteQueueRequest(queue=name))

    def get_queue(self, name: str) -> QueueDetails:
        """The queue's configuration in force and its dead-letter queue."""
        request = admin_pb2.GetQueueRequest(queue=name)
        return QueueDetails.from_proto(self._unary(self._admin.GetQueue, request))

    def update_queue(
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
        response = self._unary(self._admin.UpdateQueue, request)
        return QueueConfig.from_proto(response.config)

    def list_queues(self) -> list[QueueInfo]:
        response = self._unary(self._admin.ListQueues, admin_pb2.ListQueuesRequest())
        return [QueueInfo.from_proto(q) for q in response.queues]

    def get_stats(self, queue: str) -> QueueStats:
        response = self._unary(self._admin.GetStats, admin_pb2.GetStatsRequest(queue=queue))
        return QueueStats.from_proto(response)

    def set_config(self, key: str, value: str) -> None:
        self._unary(self._admin.SetConfig, admin_pb2.SetConfigRequest(key=key, value=value))

    def get_config(self, key: str) -> str:
        return self._unary(self._admin.GetConfig, admin_pb2.GetConfigRequest(key=key)).value

    def list_config(self, prefix: str = "") -> ConfigListing:
        response = self._unary(self._admin.ListConfig, admin_pb2.ListConfigRequest(prefix=prefix))
        return ConfigListing.from_proto(response)

    def redrive(self, dlq_queue: str, count: int = 0) -> int:
        request = admin_pb2.RedriveRequest(dlq_queue=dlq_queue, count=count)
        return self._unary(self._admin.Redrive, request).redriven

    def peek(
        self,
        queue: str,
        *,
        limit: int | None = None,
        after_id: str | None = None,
        fairness_key: str | None = None,
        state: str | None = None,
    ) -> PeekPage:
        """One page of `queue`'s ready, delayed and leased messages, in id order.

        Nothing is leased or changed, so browsing a queue (or a DLQ before a
        redrive) never disturbs its consumers. `limit` defaults to the broker's
        page size (20), at most 1,000; pass the page's `next_after_id` as
        `after_id` for the next page; `fairness_key` keeps only that key's messages,
        `state` ("ready", "delayed" or "leased") only those in that state. The page's
        `states` say each message's state, when a delayed one becomes ready and when
        a lease runs out.
        """
        request = peek_request(queue, limit, after_id, fairness_key, state)
        return PeekPage.from_proto(self._unary(self._admin.PeekMessages, request))

    def peek_all(
        self,
        queue: str,
        *,
        after_id: str | None = None,
        fairness_key: str | None = None,
        page_size: int = MAX_PEEK_LIMIT,
        state: str | None = None,
    ) -> Iterator[Message]:
        """Every message of `queue` (after `after_id`, if given) in id order, fetched
        a page at a time as iterated.

        Each page is a consistent view of its moment, not a snapshot of the whole
        queue: messages enqueued while iterating appear if their id sorts after the
        current page, and messages acked meanwhile may or may not appear.
        """
        after = after_id
        while True:
            page = self.peek(
                queue, limit=page_size, after_id=after, fairness_key=fairness_key, state=state
            )
            yield from page.messages
            if page.next_after_id is None:
                return
            after = page.next_after_id

    def purge(self, queue: str) -> int:
        """Delete every ready and delayed message of `queue`; returns how many.

        Leased messages are left to finish (ack, nack or expire), so a purge never
        pulls work from under a consumer. Durable before it returns.
        """
        request = admin_pb2.PurgeQueueRequest(queue=queue)
        return self._unary(self._admin.PurgeQueue, request).purged

    # API keys and ACLs (superadmins manage keys; see the broker's docs/semantics.md).

    def create_api_key(
        self, name: str, *, superadmin: bool = False, expires_at: datetime | None = None
    ) -> CreatedApiKey:
        """Create a key; the returned `key` is the only copy of the secret."""
        request = create_api_key_request(name, superadmin, expires_at)
        response = self._unary(self._admin.CreateApiKey, request)
        return CreatedApiKey(response.key_id, response.key, response.is_superadmin)

    def list_api_keys(self) -> list[ApiKeyInfo]:
        response = self._unary(self._admin.ListApiKeys, admin_pb2.ListApiKeysRequest())
        return [ApiKeyInfo.from_proto(k) for k in response.keys]

    def revoke_api_key(self, key_id: str) -> None:
        request = admin_pb2.RevokeApiKeyRequest(key_id=key_id)
        self._unary(self._admin.RevokeApiKey, request)

    def set_acl(self, key_id: str, permissions: Iterable[AclPermission | str]) -> None:
        """Replace the key's permissions; strings are "kind:pattern"."""
        self._unary(self._admin.SetAcl, set_acl_request(key_id, permissions))

    def get_acl(self, key_id: str) -> Acl:
        request = admin_pb2.GetAclRequest(key_id=key_id)
        return Acl.from_proto(self._unary(self._admin.GetAcl, request))


def _count(value: int | None, what: str) -> int:
    """An optional positive count for the wire (0 = the broker's default)."""
    if value is None:
        return 0
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    return value
