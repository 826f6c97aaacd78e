"""The dashboard's only way to the broker: the public `fila.v1` admin API over grpc.aio.

The dashboard is a separate process on purpose: it sees exactly what any operator's
client sees, sends its own API key (so the broker's ACLs apply to it), and never
hands that key to a browser. Connection settings and error mapping come from
`fila_sdk._channel` (and `UpdateQueue`'s request from `fila_sdk._calls`), so TLS,
mTLS, the `authorization` metadata and partial updates behave as in the CLI and the
SDK.

Every call has a short deadline and does not wait for the channel to be ready: a
page must render with a "broker unreachable" banner in about a second, not hang
while gRPC retries. The channel's reconnect backoff is capped low so that the
dashboard notices a restarted broker within a sampling interval or two.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, TypeVar

import grpc
import grpc.aio

from fila.v1 import admin_pb2, admin_pb2_grpc
from fila_sdk._calls import update_queue_request
from fila_sdk._channel import CHANNEL_OPTIONS, Settings, map_rpc_error

_RECONNECT_OPTIONS: Final = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

_Resp = TypeVar("_Resp")


class BrokerError(Exception):
    """A failed call, with the broker's own message (shown to the operator verbatim)."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    @property
    def unreachable(self) -> bool:
        """The broker could not be reached (or did not answer in time)."""
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)

    @property
    def unimplemented(self) -> bool:
        """The broker does not offer this RPC (e.g. API keys on a broker without them)."""
        return self.code == grpc.StatusCode.UNIMPLEMENTED


@dataclass(frozen=True, slots=True)
class Connection:
    """Where the broker is and how to reach it (the CLI's flags, already read)."""

    addr: str
    tls: bool = False
    ca_cert: bytes | None = None
    client_cert: bytes | None = None
    client_key: bytes | None = None
    api_key: str | None = None
    timeout: float = 3.0


class Broker:
    """Typed async calls to `FilaAdmin`; every failure becomes a `BrokerError`."""

    def __init__(self, conn: Connection) -> None:
        self._settings = Settings.build(
            conn.addr,
            tls=conn.tls,
            ca_cert=conn.ca_cert,
            client_cert=conn.client_cert,
            client_key=conn.client_key,
            api_key=conn.api_key,
            timeout=conn.timeout,
        )
        self.addr = conn.addr
        self._timeout = conn.timeout
        options = (*CHANNEL_OPTIONS, *_RECONNECT_OPTIONS)
        if self._settings.credentials is None:
            self._channel = grpc.aio.insecure_channel(conn.addr, options=options)
        else:
            self._channel = grpc.aio.secure_channel(
                conn.addr, self._settings.credentials, options=options
            )
        self._admin = admin_pb2_grpc.FilaAdminStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(None)

    async def _call(
        self, rpc: str, call: Callable[..., Awaitable[_Resp]], request: object
    ) -> _Resp:
        try:
            return await call(
                request, timeout=self._timeout, metadata=self._settings.metadata or None
            )
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise BrokerError(
                    f"broker at {self.addr} did not answer within {self._timeout:g}s",
                    err.code(),
                ) from None
            mapped = map_rpc_error(err, rpc)
            raise BrokerError(mapped.message, mapped.code) from None

    # -- queues and stats ------------------------------------------------------------

    async def list_queues(self) -> admin_pb2.ListQueuesResponse:
        return await self._call("ListQueues", self._admin.ListQueues, admin_pb2.ListQueuesRequest())

    async def get_stats(self, queue: str) -> admin_pb2.GetStatsResponse:
        return await self._call(
            "GetStats", self._admin.GetStats, admin_pb2.GetStatsRequest(queue=queue)
        )

    async def peek(
        self,
        queue: str,
        *,
        limit: int,
        after_id: str = "",
        fairness_key: str = "",
        state: admin_pb2.MessageState.ValueType = admin_pb2.MESSAGE_STATE_UNSPECIFIED,
    ) -> admin_pb2.PeekMessagesResponse:
        """A page of messages in id order (only those in `state` when it is set)."""
        request = admin_pb2.PeekMessagesRequest(
            queue=queue, limit=limit, after_id=after_id, fairness_key=fairness_key, state=state
        )
        return await self._call("PeekMessages", self._admin.PeekMessages, request)

    async def get_queue(self, queue: str) -> admin_pb2.GetQueueResponse:
        return await self._call(
            "GetQueue", self._admin.GetQueue, admin_pb2.GetQueueRequest(queue=queue)
        )

    async def update_queue(
        self,
        queue: str,
        *,
        on_enqueue: str | None = None,
        on_failure: str | None = None,
        visibility_timeout_ms: int | None = None,
        max_attempts: int | None = None,
        retry_backoff: str | None = None,
    ) -> admin_pb2.QueueConfig:
        """Changes only the settings given (the update mask names them; "" clears a
        script), as the SDK's `update_queue`; returns the configuration in force after."""
        request = update_queue_request(
            queue, on_enqueue, on_failure, visibility_timeout_ms, max_attempts, retry_backoff
        )
        reply = await self._call("UpdateQueue", self._admin.UpdateQueue, request)
        return reply.config

    async def purge(self, queue: str) -> int:
        reply = await self._call(
            "PurgeQueue", self._admin.PurgeQueue, admin_pb2.PurgeQueueRequest(queue=queue)
        )
        return int(reply.purged)

    async def redrive(self, dlq: str, count: int) -> int:
        reply = await self._call(
            "Redrive", self._admin.Redrive, admin_pb2.RedriveRequest(dlq_queue=dlq, count=count)
        )
        return int(reply.redriven)

    # -- runtime config ----------------------------------------------------------------

    async def list_config(self, prefix: str = "") -> admin_pb2.ListConfigResponse:
        return await self._call(
            "ListConfig", self._admin.ListConfig, admin_pb2.ListConfigRequest(prefix=prefix)
        )

    async def set_config(self, key: str, value: str) -> None:
        """An empty value deletes the entry: the API has no separate delete call."""
        await self._call(
            "SetConfig", self._admin.SetConfig, admin_pb2.SetConfigRequest(key=key, value=value)
        )

    # -- API keys and ACLs (superadmin) -----------------------------------------------

    async def list_api_keys(self) -> list[admin_pb2.ApiKeyInfo]:
        reply = await self._call(
            "ListApiKeys", self._admin.ListApiKeys, admin_pb2.ListApiKeysRequest()
        )
        return list(reply.keys)

    async def create_api_key(
        self, name: str, *, expires_at_ms: int, is_superadmin: bool
    ) -> admin_pb2.CreateApiKeyResponse:
        request = admin_pb2.CreateApiKeyRequest(
            name=name, expires_at_ms=expires_at_ms, is_superadmin=is_superadmin
        )
        return await self._call("CreateApiKey", self._admin.CreateApiKey, request)

    async def revoke_api_key(self, key_id: str) -> None:
        await self._call(
            "RevokeApiKey", self._admin.RevokeApiKey, admin_pb2.RevokeApiKeyRequest(key_id=key_id)
        )

    async def get_acl(self, key_id: str) -> admin_pb2.GetAclResponse:
        return await self._call(
            "GetAcl", self._admin.GetAcl, admin_pb2.GetAclRequest(key_id=key_id)
        )

    async def set_acl(self, key_id: str, permissions: list[tuple[str, str]]) -> None:
        request = admin_pb2.SetAclRequest(
            key_id=key_id,
            permissions=[admin_pb2.AclPermission(kind=k, pattern=p) for k, p in permissions],
        )
        await self._call("SetAcl", self._admin.SetAcl, request)
