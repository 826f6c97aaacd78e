"""What the sync and async clients share: connection settings and error mapping.

Both clients are thin shells over the generated stubs; everything that decides
behaviour (credentials, auth metadata, which exception a failure becomes) lives
here once, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final, cast

import grpc

from fila.v1 import admin_pb2
from fila.wire import ERROR_KIND_METADATA_KEY, ErrorKind

from .errors import (
    ApiKeyNotFoundError,
    ConfigKeyNotFoundError,
    FilaError,
    InvalidArgumentError,
    MessageNotFoundError,
    PermissionDeniedError,
    QueueAlreadyExistsError,
    QueueNotFoundError,
    ResourceExhaustedError,
    RPCError,
    UnauthenticatedError,
    UnavailableError,
)
from .types import AclPermission

# The broker enforces its own payload limit (configurable above gRPC's 4 MiB
# default), so the client must not reject a large message the broker accepted.
CHANNEL_OPTIONS: Final = (("grpc.max_receive_message_length", -1),)

_BY_KIND: Final[Mapping[str, type[FilaError]]] = {
    ErrorKind.QUEUE_NOT_FOUND: QueueNotFoundError,
    ErrorKind.QUEUE_ALREADY_EXISTS: QueueAlreadyExistsError,
    ErrorKind.MESSAGE_NOT_FOUND: MessageNotFoundError,
    ErrorKind.CONFIG_KEY_NOT_FOUND: ConfigKeyNotFoundError,
    ErrorKind.API_KEY_NOT_FOUND: ApiKeyNotFoundError,
    ErrorKind.INVALID_ARGUMENT: InvalidArgumentError,
    ErrorKind.UNAUTHENTICATED: UnauthenticatedError,
    ErrorKind.PERMISSION_DENIED: PermissionDeniedError,
    ErrorKind.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    ErrorKind.UNAVAILABLE: UnavailableError,
    ErrorKind.UNIMPLEMENTED: RPCError,
    ErrorKind.INTERNAL: RPCError,
}

_BY_CODE: Final[Mapping[grpc.StatusCode, type[FilaError]]] = {
    grpc.StatusCode.NOT_FOUND: QueueNotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: QueueAlreadyExistsError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
}

# Without the error-kind metadata (an older or foreign broker), NOT_FOUND is
# ambiguous; the RPC that failed tells what was missing.
_NOT_FOUND_BY_RPC: Final[Mapping[str, type[FilaError]]] = {
    "Ack": MessageNotFoundError,
    "Nack": MessageNotFoundError,
    "GetConfig": ConfigKeyNotFoundError,
    "RevokeApiKey": ApiKeyNotFoundError,
    "SetAcl": ApiKeyNotFoundError,
    "GetAcl": ApiKeyNotFoundError,
}


def map_rpc_error(err: grpc.RpcError, rpc: str) -> FilaError:
    """Turn a failed call of `rpc` (e.g. "Ack") into the matching `FilaError`."""
    code = err.code()
    message = err.details() or code.name.lower()
    # Sync errors carry a tuple of pairs, grpc.aio ones a Metadata; both iterate as pairs.
    trailers = cast(Iterable[tuple[str, str | bytes]], err.trailing_metadata() or ())
    kind = next((value for key, value in trailers if key == ERROR_KIND_METADATA_KEY), None)
    if isinstance(kind, str) and kind in _BY_KIND:
        return _BY_KIND[kind](message, code)
    if code == grpc.StatusCode.NOT_FOUND:
        return _NOT_FOUND_BY_RPC.get(rpc, QueueNotFoundError)(message, code)
    if code == grpc.StatusCode.UNAVAILABLE and kind is None:
        # Raised by the channel itself (refused, DNS, TLS), not by the broker.
        message = f"broker unavailable: {message}"
    return _BY_CODE.get(code, RPCError)(message, code)


@dataclass(frozen=True, slots=True)
class Settings:
    """Validated constructor arguments, identical for `Client` and `AsyncClient`."""

    target: str
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]
    timeout: float | None

    @classmethod
    def build(
        cls,
        addr: str,
        *,
        tls: bool,
        ca_cert: bytes | None,
        client_cert: bytes | None,
        client_key: bytes | None,
        api_key: str | None,
        timeout: float | None,
    ) -> Settings:
        if (client_cert is None) != (client_key is None):
            raise ValueError("client_cert and client_key must be given together")
        credentials = None
        # Passing any certificate is an unambiguous request for TLS.
        if tls or ca_cert is not None or client_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=ca_cert, private_key=client_key, certificate_chain=client_cert
            )
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        return cls(addr, credentials, metadata, timeout)


def queue_config(
    on_enqueue: str | None, on_failure: str | None, visibility_timeout_ms: int | None
) -> admin_pb2.QueueConfig:
    # Empty strings and 0 are the wire's "not set": the broker applies its defaults.
    return admin_pb2.QueueConfig(
        on_enqueue_script=on_enqueue or "",
        on_failure_script=on_failure or "",
        visibility_timeout_ms=visibility_timeout_ms or 0,
    )


# The broker's largest peek page; `peek_all` asks for full pages so that walking a
# queue costs as few calls as possible. (Larger limits are capped by the broker.)
MAX_PEEK_LIMIT: Final = 1000


def peek_request(
    queue: str, limit: int | None, after_id: str | None, fairness_key: str | None
) -> admin_pb2.PeekMessagesRequest:
    # 0 and "" are the wire's "not set": the broker's default page size (20), from the
    # start of the queue, every fairness key.
    return admin_pb2.PeekMessagesRequest(
        queue=queue, limit=limit or 0, after_id=after_id or "", fairness_key=fairness_key or ""
    )


def create_api_key_request(
    name: str, superadmin: bool, expires_at: datetime | None
) -> admin_pb2.CreateApiKeyRequest:
    # A naive datetime is local time, as datetime.timestamp() reads it; 0 means never.
    expires_at_ms = 0 if expires_at is None else int(expires_at.timestamp() * 1000)
    return admin_pb2.CreateApiKeyRequest(
        name=name, expires_at_ms=expires_at_ms, is_superadmin=superadmin
    )


def set_acl_request(
    key_id: str, permissions: Iterable[AclPermission | str]
) -> admin_pb2.SetAclRequest:
    """`permissions` as `AclPermission`s or "kind:pattern" strings."""
    parsed = [AclPermission.parse(p) if isinstance(p, str) else p for p in permissions]
    return admin_pb2.SetAclRequest(
        key_id=key_id,
        permissions=[admin_pb2.AclPermission(kind=p.kind, pattern=p.pattern) for p in parsed],
    )
