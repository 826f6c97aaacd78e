"""Blocking client; safe to share between threads.

Unary and batch calls (`ack`, `enqueue_many`, admin, ...) run on a gRPC sync
channel in the calling thread; their requests and the records their answers become
are built in `fila_sdk._calls`, shared with `AsyncClient`. Streams need something
reading them while callers block, so `enqueue` (which rides an open `StreamEnqueue`
stream) and `Worker` run the `AsyncClient` machinery on a private event loop thread,
started on first use (see `fila_sdk._loop`): one implementation of the stream
protocols, and calls from many threads coalesce into the same requests. The cost is
a second connection to the broker for those streams, and a thread hand-off per
`enqueue`.

`consume` stays a plain server stream read in the caller's thread, outlives
broker restarts (see `fila_sdk.retry`) and, in a cluster, follows the queue to its
node (see `fila_sdk.leader`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, Self, TypeVar, overload

import grpc
from google.protobuf.message import Message as ProtoMessage

from fila.v1 import admin_pb2_grpc, service_pb2, service_pb2_grpc

from . import _calls as calls
from ._calls import MAX_PEEK_LIMIT, BatchSettlement, Call
from ._channel import ChannelOptions, Settings, call_error, not_ready
from ._loop import LoopThread
from .aio import AsyncClient
from .arguments import UNSET, Payload, enqueue_arguments, json_arguments
from .batching import PIPELINE_DEPTH, EnqueueLike, NackItem
from .errors import ClientClosedError, FilaError
from .leader import SyncLeaders
from .retry import Reconnector, sync_probe
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
_R = TypeVar("_R")


class Client:
    """A blocking connection (or `connections` of them) to one broker at `addr`
    ("host:port"), safe to share between threads.

    `tls` (or any of `ca_cert`, `client_cert` and `client_key`, PEM bytes) connects
    over TLS, with a client certificate for mTLS; `api_key` is sent with every call.
    `timeout` (seconds) bounds every call except `consume`, whose stream lives as long
    as the caller reads it. `reconnect_timeout` is how long a consumer keeps trying to
    get back to a broker it lost (None: forever) before it raises
    `BrokerUnreachableError`. `connections` > 1 opens that many TCP connections and
    spreads enqueue streams and batch calls over them round-robin; `channel_options`
    are extra gRPC channel arguments, applied last.

    Raises `ValueError` for a client certificate without its key (or the reverse),
    `connections` < 1 or a negative `reconnect_timeout`. Nothing is sent before the
    first call (`wait_ready` checks the broker can be reached).

    Besides the errors each method names, any call can raise `UnavailableError` (the
    broker cannot be reached or is shutting down), `DeadlineExceededError` (no answer
    within `timeout`), `UnauthenticatedError` or `PermissionDeniedError` (the API key
    is refused, or lacks the permission), `ResourceExhaustedError` (the broker sheds
    load) and `ClientClosedError` (the client is closed, or was closed during the
    call); every one is a `FilaError`.
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
        self._batches = BatchSettlement()
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
        """The validated connection settings (`settings.target` is the address)."""
        return self._settings

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def close(self) -> None:
        """Close the connections; open `consume` iterators end quietly, and calls still
        waiting for an answer raise `ClientClosedError`. Closing twice does nothing."""
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

        Raises `UnavailableError` if it does not within `timeout` seconds.
        """
        self._check_open()
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise not_ready(self._settings.target, timeout) from None

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

    def _stub(self, call: Call[Any, Any]) -> Any:
        """The method of `call` on its service's stub (admin calls on the first
        connection, the others round-robin)."""
        return getattr(self._admin if call.admin else self._next_service(), call.method)

    def _unary(self, rpc: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        self._check_open()
        try:
            return rpc(request, timeout=self._settings.timeout, metadata=self._settings.metadata)
        except grpc.RpcError as err:
            method = type(request).__name__.removesuffix("Request")
            raise call_error(err, method, self._closed) from err
        except ValueError as err:  # grpc: "Cannot invoke RPC on closed channel!"
            if self._closed:
                raise ClientClosedError() from err
            raise

    def _call(self, call: Call[Any, _R]) -> _R:
        """Makes `call` and returns what its answer becomes."""
        try:
            response = self._unary(self._stub(call), call.request)
        except FilaError as error:
            return call.failed(error)
        return call.answer(response)

    def _start(self, call: Call[Any, _R]) -> Callable[[], _R]:
        """Sends `call` without waiting for it (so that several are in flight); the
        function returned waits for its result (or raises, as `_call` would)."""
        if self._closed:
            return lambda: call.failed(ClientClosedError())
        future = self._stub(call).future(
            call.request, timeout=self._settings.timeout, metadata=self._settings.metadata
        )

        def result() -> _R:
            try:
                response = future.result()
            except grpc.RpcError as err:
                return call.failed(call_error(err, call.method, self._closed))
            return call.answer(response)

        return result

    def _outcome(self, call: Call[Any, None]) -> FilaError | None:
        """None if `call` succeeded, else its error."""
        try:
            self._call(call)
        except FilaError as error:
            return error
        return None

    def streams(self) -> tuple[LoopThread, AsyncClient]:
        """The private loop thread and the `AsyncClient` on it, started on first use
        (for `enqueue` and `Worker`). Raises `ClientClosedError` once closed."""
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
        """Store one message in `queue` and return its id once it is durable.

        `enqueue(queue, payload, headers=...)`, or the published order
        `enqueue(queue, headers, payload)`; a `str` payload is sent as UTF-8 (see
        `fila_sdk.arguments`). `delay` (a `timedelta` or seconds) makes the message
        ready only that long after. Calls from many threads travel together in one
        request on an open `StreamEnqueue` stream; each still gets its own id or
        exception.

        Raises `ArgumentError` for a payload or headers of the wrong kind (nothing is
        sent), `QueueNotFoundError`, `InvalidArgumentError` (the broker refused the
        message, e.g. over its size limit) or `ResourceExhaustedError` (the queue is
        full). If the stream fails, whether the message was stored is unknown: the
        error says so, and the next call opens a new stream.
        """
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
        """`enqueue` of `value` as JSON, with `content-type: application/json` (unless
        `headers` name a content type); read it back with `Message.json()`. Raises
        `ArgumentError` if `value` is not JSON, else as `enqueue`."""
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
        """Store many messages in few `EnqueueBatch` calls; one result per item, in order:
        its message id, or the `FilaError` that item alone failed with (a call that
        failed as a whole fails each of its items). Never raises for an item.

        An item is an `EnqueueItem`, a payload (`bytes` or `str`), or a (headers,
        payload) or (headers, payload, delay) tuple. Raises `ArgumentError` for an item
        of the wrong kind, before anything is sent."""
        self._check_open()
        results: list[str | FilaError] = []
        window: deque[Callable[[], list[str | FilaError]]] = deque()
        for call in calls.enqueue_batches(queue, items):
            window.append(self._start(call))
            if len(window) >= PIPELINE_DEPTH:
                results += window.popleft()()
        for result in window:
            results += result()
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
        not acked stay leased to the lost stream until their visibility timeout).

        Raises `ValueError` for a `prefetch` or `max_batch` below 1; while iterating,
        `QueueNotFoundError` (or another error that opening the stream again would
        not cure), or `BrokerUnreachableError` if the broker stays away for the
        client's `reconnect_timeout`.
        """
        self._check_open()
        return self._consume(calls.consume_request(queue, prefetch, max_batch))

    def _consume(self, request: service_pb2.ConsumeRequest) -> Generator[Message, None, None]:
        what = f"consumer of {request.queue!r}"
        subscription = Subscription(what, self._leaders, Reconnector.of(what, self._settings))
        from_proto = Message.from_proto
        while True:
            try:
                call = subscription.service.Consume(request, metadata=self._settings.metadata)
            except ValueError:  # the channel was closed meanwhile
                if self._closed:
                    return
                raise
            error: FilaError
            try:
                for frame in call:
                    for message in subscription.messages(frame):
                        yield from_proto(message)
                return  # the server ended the stream (Fila never does; a foreign server may)
            except grpc.RpcError as err:
                if self._closed:
                    return
                if subscription.redirected(err):  # the queue's owner is elsewhere
                    continue
                error = subscription.failed(err, "Consume")
            finally:
                call.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves it untyped
            try:
                reconnector = subscription.reconnector
                if self._closed or not reconnector.wait_sync(
                    error, self._probe, self._closed_event
                ):
                    return
            except ValueError:  # grpc: the channel was closed meanwhile
                if self._closed:
                    return
                raise

    def ack(self, queue: str, message_id: str) -> None:
        """Acknowledge a leased message: it is done and deleted, durably before this
        returns. Raises `MessageNotFoundError` if the id is not leased in `queue`
        (already acked, its lease expired, or never delivered)."""
        self._call(calls.ack(queue, message_id))

    def nack(self, queue: str, message_id: str, error: str = "") -> None:
        """Report a leased message as failed, with `error` (cut to a bounded size) as
        the reason: the queue's retry policy or `on_failure` hook decides whether it is
        retried or dead-lettered. Raises `MessageNotFoundError` as `ack` does."""
        self._call(calls.nack(queue, message_id, error))

    def ack_many(self, queue: str, message_ids: Iterable[str]) -> list[FilaError | None]:
        """Ack many messages in few `AckBatch` calls; per item None (acked) or its error
        (e.g. `MessageNotFoundError`). Never raises for an item."""
        return self._settle_many(calls.ack_batches(queue, message_ids))

    def nack_many(
        self, queue: str, items: Iterable[NackItem], error: str = ""
    ) -> list[FilaError | None]:
        """Nack many messages in few `NackBatch` calls. An item is a message id (nacked
        with `error`) or a (message id, error) pair; per item None or its error. Never
        raises for an item."""
        return self._settle_many(calls.nack_batches(queue, items, error))

    def extend_lease(
        self, queue: str, message_id: str, extend: timedelta | float | None = None
    ) -> datetime:
        """Push a leased message's deadline to now + `extend` (a `timedelta` or seconds;
        None: the queue's visibility timeout); returns the new deadline. Raises
        `MessageNotFoundError` if the message is not leased (any more)."""
        return self._call(calls.extend_lease(queue, message_id, extend))

    def _settle_many(
        self, requests: Iterator[service_pb2.AckBatchRequest | service_pb2.NackBatchRequest]
    ) -> list[FilaError | None]:
        self._check_open()
        return [outcome for request in requests for outcome in self._settle(request)]

    def _settle(
        self, request: service_pb2.AckBatchRequest | service_pb2.NackBatchRequest
    ) -> list[FilaError | None]:
        """One AckBatch / NackBatch (unary calls against a broker without them); per item
        None or its error."""
        outcome = self._call(self._batches.call(request)) if self._batches.available else None
        if outcome is None:
            outcome = [self._outcome(call) for call in calls.one_by_one(request)]
        return outcome

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
        """Create queue `name` (and its dead-letter queue `name.dlq`); returns its id
        (the name).

        `on_enqueue` and `on_failure` are Lua hook scripts, `visibility_timeout_ms` how
        long a lease lasts, `max_attempts` and `retry_backoff` the retry policy; None
        takes the broker's defaults. With `exist_ok`, a queue of that name already
        existing is success, so setup code can run on every start; the existing queue
        keeps its own hooks and timeout (they are not compared with these).

        Raises `QueueAlreadyExistsError` (without `exist_ok`), or
        `InvalidArgumentError` for a bad name or a script that does not compile.
        """
        config = calls.queue_config(
            on_enqueue, on_failure, visibility_timeout_ms, max_attempts, retry_backoff
        )
        return self._call(calls.create_queue(name, config, exist_ok))

    def delete_queue(self, name: str) -> None:
        """Delete queue `name` with its messages, leases and dead-letter queue. Raises
        `QueueNotFoundError`, or `InvalidArgumentError` for a dead-letter queue on its
        own."""
        self._call(calls.delete_queue(name))

    def get_queue(self, name: str) -> QueueDetails:
        """The queue's configuration in force and its dead-letter queue. Raises
        `QueueNotFoundError`."""
        return self._call(calls.get_queue(name))

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
        enqueued after this returns see the new configuration.

        Raises `ValueError` if no setting is given, `QueueNotFoundError`, or
        `InvalidArgumentError` for a script that does not compile or a bad value."""
        request = calls.update_queue_request(
            name, on_enqueue, on_failure, visibility_timeout_ms, max_attempts, retry_backoff
        )
        return self._call(calls.update_queue(request))

    def list_queues(self) -> list[QueueInfo]:
        """Every queue, with its depth, in-flight count and active consumers."""
        return self._call(calls.list_queues())

    def get_stats(self, queue: str) -> QueueStats:
        """The queue's counters: depth, in flight, delayed, per fairness key and throttle
        key. Raises `QueueNotFoundError`."""
        return self._call(calls.get_stats(queue))

    def set_config(self, key: str, value: str) -> None:
        """Set a runtime configuration value (read by Lua hooks with `fila.get`), or
        delete it with ""; durable before this returns. Raises `InvalidArgumentError`
        for an empty or oversized key, an oversized value or a bad `throttle.*`
        value."""
        self._call(calls.set_config(key, value))

    def get_config(self, key: str) -> str:
        """A runtime configuration value. Raises `ConfigKeyNotFoundError`."""
        return self._call(calls.get_config(key))

    def list_config(self, prefix: str = "") -> ConfigListing:
        """The runtime configuration values whose key starts with `prefix` (all by
        default)."""
        return self._call(calls.list_config(prefix))

    def redrive(self, dlq_queue: str, count: int = 0) -> int:
        """Move up to `count` messages (0: all) from dead-letter queue `dlq_queue` back
        to its source queue, as fresh attempts; returns how many moved. Raises
        `QueueNotFoundError`, or `InvalidArgumentError` if `dlq_queue` is not a
        dead-letter queue."""
        return self._call(calls.redrive(dlq_queue, count))

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

        Raises `ValueError` for an unknown `state`, `QueueNotFoundError`.
        """
        return self._call(calls.peek(queue, limit, after_id, fairness_key, state))

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
        a page at a time as iterated; raises as `peek`.

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
        pulls work from under a consumer. Durable before it returns. Raises
        `QueueNotFoundError`.
        """
        return self._call(calls.purge(queue))

    # API keys and ACLs (superadmins manage keys; see the broker's docs/semantics.md).

    def create_api_key(
        self, name: str, *, superadmin: bool = False, expires_at: datetime | None = None
    ) -> CreatedApiKey:
        """Create an API key named `name` (a superadmin's may do anything; others only
        what their ACL grants), valid until `expires_at` (None: no expiry); the
        returned `key` is the only copy of the secret. Raises `InvalidArgumentError`
        for a bad name or an expiry in the past."""
        return self._call(calls.create_api_key(name, superadmin, expires_at))

    def list_api_keys(self) -> list[ApiKeyInfo]:
        """Every API key, without its secret."""
        return self._call(calls.list_api_keys())

    def revoke_api_key(self, key_id: str) -> None:
        """Revoke a key: calls made with it are refused from now on. Raises
        `ApiKeyNotFoundError`."""
        self._call(calls.revoke_api_key(key_id))

    def set_acl(self, key_id: str, permissions: Iterable[AclPermission | str]) -> None:
        """Replace the key's permissions; strings are "kind:pattern" (e.g.
        "produce:orders.*"). Raises `ValueError` for a malformed string,
        `ApiKeyNotFoundError`, or `InvalidArgumentError` for an unknown kind."""
        self._call(calls.set_acl(key_id, permissions))

    def get_acl(self, key_id: str) -> Acl:
        """The key's permissions. Raises `ApiKeyNotFoundError`."""
        return self._call(calls.get_acl(key_id))
