"""asyncio client over `grpc.aio`; same methods as `Client`, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from datetime import datetime
from types import TracebackType
from typing import Self, TypeVar

import grpc
import grpc.aio
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


class AsyncClient:
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
            self._channel = grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.aio.secure_channel(
                addr, self._settings.credentials, options=CHANNEL_OPTIONS
            )
        self._service = service_pb2_grpc.FilaServiceStub(self._channel)
        self._admin = admin_pb2_grpc.FilaAdminStub(self._channel)
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; open `consume` iterators end quietly."""
        self._closed = True
        await self._channel.close(None)

    async def wait_ready(self, timeout: float) -> None:  # noqa: ASYNC109 (mirrors Client)
        """Wait until the broker accepts a connection; see `Client.wait_ready`."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            raise UnavailableError(
                f"cannot reach broker at {self._settings.target} within {timeout:g}s",
                grpc.StatusCode.UNAVAILABLE,
            ) from None

    async def _unary(
        self, rpc: grpc.aio.UnaryUnaryMultiCallable[_Req, _Resp], request: _Req
    ) -> _Resp:
        try:
            return await rpc(
                request, timeout=self._settings.timeout, metadata=self._settings.metadata
            )
        except grpc.RpcError as err:
            raise map_rpc_error(err, type(request).__name__.removesuffix("Request")) from err

    # Hot path.

    async def enqueue(self, queue: str, headers: Mapping[str, str] | None, payload: bytes) -> str:
        request = service_pb2.EnqueueRequest(queue=queue, headers=headers, payload=payload)
        return (await self._unary(self._service.Enqueue, request)).message_id

    async def consume(self, queue: str) -> AsyncGenerator[Message, None]:
        """Yield messages as the broker leases them; see `Client.consume`.

        Wrap in `contextlib.aclosing` to cancel the stream at a deterministic point
        rather than when the abandoned generator is collected.
        """
        call = self._service.Consume(
            service_pb2.ConsumeRequest(queue=queue), metadata=self._settings.metadata
        )
        try:
            async for response in call:
                if response.HasField("message"):  # skip keepalive frames
                    yield Message.from_proto(response.message)
        except grpc.RpcError as err:
            if self._closed and err.code() == grpc.StatusCode.CANCELLED:
                return
            raise map_rpc_error(err, "Consume") from err
        except asyncio.CancelledError:
            # grpc.aio reports a call cancelled by close() as CancelledError; swallow
            # only that one, never a cancellation of the consuming task itself.
            task = asyncio.current_task()
            if self._closed and task is not None and not task.cancelling():
                return
            raise
        finally:
            call.cancel()

    async def ack(self, queue: str, message_id: str) -> None:
        request = service_pb2.AckRequest(queue=queue, message_id=message_id)
        await self._unary(self._service.Ack, request)

    async def nack(self, queue: str, message_id: str, error: str = "") -> None:
        request = service_pb2.NackRequest(queue=queue, message_id=message_id, error=error)
        await self._unary(self._service.Nack, request)

    # Admin.

    async def create_queue(
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
            return (await self._unary(self._admin.CreateQueue, request)).queue_id
        except QueueAlreadyExistsError:
            if not exist_ok:
                raise
            return name

    async def delete_queue(self, name: str) -> None:
        await self._unary(self._admin.DeleteQueue, admin_pb2.DeleteQueueRequest(queue=name))

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
    ) -> PeekPage:
        """One page of `queue`'s messages without leasing them; see `Client.peek`."""
        request = peek_request(queue, limit, after_id, fairness_key)
        return PeekPage.from_proto(await self._unary(self._admin.PeekMessages, request))

    async def peek_all(
        self,
        queue: str,
        *,
        after_id: str | None = None,
        fairness_key: str | None = None,
        page_size: int = MAX_PEEK_LIMIT,
    ) -> AsyncIterator[Message]:
        """Every message of `queue` in id order, page by page; see `Client.peek_all`."""
        after = after_id
        while True:
            page = await self.peek(
                queue, limit=page_size, after_id=after, fairness_key=fairness_key
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
