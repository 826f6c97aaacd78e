"""Blocking client; every method is one RPC, safe to share between threads."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Mapping
from datetime import datetime
from types import TracebackType
from typing import Self, TypeVar

import grpc
from google.protobuf.message import Message as ProtoMessage

from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2, service_pb2_grpc

from ._channel import (
    CHANNEL_OPTIONS,
    MAX_PEEK_LIMIT,
    Settings,
    create_api_key_request,
    map_rpc_error,
    peek_request,
    queue_config,
    set_acl_request,
)
from .errors import QueueAlreadyExistsError, UnavailableError
from .types import (
    Acl,
    AclPermission,
    ApiKeyInfo,
    ConfigListing,
    CreatedApiKey,
    Message,
    PeekPage,
    QueueInfo,
    QueueStats,
)

_Req = TypeVar("_Req", bound=ProtoMessage)
_Resp = TypeVar("_Resp", bound=ProtoMessage)


class Client:
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
    ) -> None:
        self._settings = Settings.build(
            addr,
            tls=tls,
            ca_cert=ca_cert,
            client_cert=client_cert,
            client_key=client_key,
            api_key=api_key,
            timeout=timeout,
        )
        if self._settings.credentials is None:
            self._channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(
                addr, self._settings.credentials, options=CHANNEL_OPTIONS
            )
        self._service = service_pb2_grpc.FilaServiceStub(self._channel)
        self._admin = admin_pb2_grpc.FilaAdminStub(self._channel)
        self._closed = False

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the channel; open `consume` iterators end quietly."""
        self._closed = True
        self._channel.close()

    def wait_ready(self, timeout: float) -> None:
        """Block until the broker accepts a connection, so that callers (a CLI, a test,
        a deploy script) can fail fast with one clear error instead of on the first RPC.
        """
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(
                f"cannot reach broker at {self._settings.target} within {timeout:g}s",
                grpc.StatusCode.UNAVAILABLE,
            ) from None

    def _unary(self, rpc: grpc.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req) -> _Resp:
        try:
            return rpc(request, timeout=self._settings.timeout, metadata=self._settings.metadata)
        except grpc.RpcError as err:
            raise map_rpc_error(err, type(request).__name__.removesuffix("Request")) from err

    # Hot path.

    def enqueue(self, queue: str, headers: Mapping[str, str] | None, payload: bytes) -> str:
        request = service_pb2.EnqueueRequest(queue=queue, headers=headers, payload=payload)
        return self._unary(self._service.Enqueue, request).message_id

    def consume(self, queue: str) -> Generator[Message, None, None]:
        """Yield messages as the broker leases them; the stream opens on first `next()`.

        Leaving the loop, closing the generator or closing the client cancels the
        stream, so the broker stops leasing to this consumer at once.
        """
        call = self._service.Consume(
            service_pb2.ConsumeRequest(queue=queue), metadata=self._settings.metadata
        )
        try:
            for response in call:
                if response.HasField("message"):  # skip keepalive frames
                    yield Message.from_proto(response.message)
        except grpc.RpcError as err:
            if self._closed and err.code() == grpc.StatusCode.CANCELLED:
                return
            raise map_rpc_error(err, "Consume") from err
        finally:
            call.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leaves it untyped

    def ack(self, queue: str, message_id: str) -> None:
        self._unary(self._service.Ack, service_pb2.AckRequest(queue=queue, message_id=message_id))

    def nack(self, queue: str, message_id: str, error: str = "") -> None:
        request = service_pb2.NackRequest(queue=queue, message_id=message_id, error=error)
        self._unary(self._service.Nack, request)

    # Admin.

    def create_queue(
        self,
        name: str,
        *,
        on_enqueue: str | None = None,
        on_failure: str | None = None,
        visibility_timeout_ms: int | None = None,
        exist_ok: bool = False,
    ) -> str:
        """Create queue `name` (and `name.dlq`); returns its id (the name).

        With `exist_ok`, a queue of that name already existing is success, so setup
        code can run on every start; the existing queue keeps its own hooks and
        timeout (they are not compared with these).
        """
        config = queue_config(on_enqueue, on_failure, visibility_timeout_ms)
        request = admin_pb2.CreateQueueRequest(name=name, config=config)
        try:
            return self._unary(self._admin.CreateQueue, request).queue_id
        except QueueAlreadyExistsError:
            if not exist_ok:
                raise
            return name

    def delete_queue(self, name: str) -> None:
        self._unary(self._admin.DeleteQueue, admin_pb2.DeleteQueueRequest(queue=name))

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
    ) -> PeekPage:
        """One page of `queue`'s ready, delayed and leased messages, in id order.

        Nothing is leased or changed, so browsing a queue (or a DLQ before a
        redrive) never disturbs its consumers. `limit` defaults to the broker's
        page size (20), at most 1,000; pass the page's `next_after_id` as
        `after_id` for the next page; `fairness_key` keeps only that key's messages.
        """
        request = peek_request(queue, limit, after_id, fairness_key)
        return PeekPage.from_proto(self._unary(self._admin.PeekMessages, request))

    def peek_all(
        self,
        queue: str,
        *,
        after_id: str | None = None,
        fairness_key: str | None = None,
        page_size: int = MAX_PEEK_LIMIT,
    ) -> Iterator[Message]:
        """Every message of `queue` (after `after_id`, if given) in id order, fetched
        a page at a time as iterated.

        Each page is a consistent view of its moment, not a snapshot of the whole
        queue: messages enqueued while iterating appear if their id sorts after the
        current page, and messages acked meanwhile may or may not appear.
        """
        after = after_id
        while True:
            page = self.peek(queue, limit=page_size, after_id=after, fairness_key=fairness_key)
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
