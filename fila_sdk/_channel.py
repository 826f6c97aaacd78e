"""What the sync and async clients share: connection settings and error mapping.

Both clients are thin shells over the generated stubs; everything that decides
behaviour (credentials, auth metadata, which exception a failure becomes) lives
here once, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final, cast

import grpc
import grpc.aio

from fila.v1 import admin_pb2, service_pb2
from fila.wire import ERROR_KIND_METADATA_KEY, ErrorKind

from .errors import (
    ApiKeyNotFoundError,
    ConfigKeyNotFoundError,
    DeadlineExceededError,
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
from .tracing import with_trace_context
from .types import MESSAGE_STATES, AclPermission

ChannelOptions = Sequence[tuple[str, str | int]]

CHANNEL_OPTIONS: Final[tuple[tuple[str, int], ...]] = (
    # The broker enforces its own payload limit (configurable above gRPC's 4 MiB
    # default), so the client must not reject a large message the broker accepted.
    ("grpc.max_receive_message_length", -1),
    # gRPC's default reconnect backoff (1 s growing to 120 s) left a client unusable
    # for seconds after a restarted broker was back; retrying the connection every
    # 100 ms to 500 ms makes it usable within a fraction of a second (figures:
    # docs/benchmarks.md, "Measurements behind design choices"), at the cost of a
    # refused TCP connect per half second while the broker is down. The connect
    # timeout (grpc.min_reconnect_backoff_ms, 20 s) is left alone for slow links.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
    # gRPC shares one connection between channels to the same address with the same
    # arguments: a new Client would inherit another one's backoff after a broker
    # restart and fail its first call although the broker is back. Each channel keeps
    # its own connection instead (this is also what `connections=` relies on).
    ("grpc.use_local_subchannel_pool", 1),
)

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
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
}

_STATUS_BY_NUMBER: Final[Mapping[int, grpc.StatusCode]] = {
    code.value[0]: code for code in grpc.StatusCode
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


def from_broker(err: grpc.RpcError) -> bool:
    """The broker's own answer (it carries `x-fila-error-kind`), not the transport's."""
    trailers = cast(Iterable[tuple[str, str | bytes]], err.trailing_metadata() or ())
    return any(key == ERROR_KIND_METADATA_KEY for key, _ in trailers)


def interrupted(err: grpc.RpcError) -> bool:
    """A stream that grpc.aio reports as INTERNAL without the broker's error kind: the
    broker ended it while the client was writing, and the real status was lost (see
    `fila_sdk.streams.stream_ending`). The broker's own INTERNAL carries its kind."""
    return err.code() == grpc.StatusCode.INTERNAL and not from_broker(err)


def map_batch_error(error: service_pb2.BatchError, rpc: str) -> FilaError:
    """One failed item of a batch RPC, as the single `rpc` would have raised it."""
    code = _STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
    message = error.message or code.name.lower()
    if error.kind in _BY_KIND:
        return _BY_KIND[error.kind](message, code)
    if code == grpc.StatusCode.NOT_FOUND:
        return _NOT_FOUND_BY_RPC.get(rpc, QueueNotFoundError)(message, code)
    return _BY_CODE.get(code, RPCError)(message, code)


def milliseconds(duration: timedelta | float | None, what: str) -> int:
    """A duration (a `timedelta` or seconds) as whole milliseconds for the wire,
    rounded up so that a positive duration never becomes "none" (0)."""
    if duration is None:
        return 0
    seconds = duration.total_seconds() if isinstance(duration, timedelta) else float(duration)
    if not seconds >= 0:  # also refuses NaN
        raise ValueError(f"{what} must be zero or positive, got {duration!r}")
    millis = seconds * 1000
    whole = int(millis)
    return whole + 1 if millis > whole else whole


@dataclass(frozen=True, slots=True)
class Settings:
    """Validated constructor arguments, identical for `Client` and `AsyncClient`."""

    target: str
    credentials: grpc.ChannelCredentials | None
    auth_metadata: tuple[tuple[str, str], ...]
    timeout: float | None
    options: tuple[tuple[str, str | int], ...]
    connections: int
    reconnect_timeout: float | None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What each call sends: the API key, and the caller's trace context when
        OpenTelemetry is active (see `fila_sdk.tracing`); read at every call."""
        return with_trace_context(self.auth_metadata)

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
        channel_options: ChannelOptions | None = None,
        connections: int = 1,
        reconnect_timeout: float | None = 30.0,
    ) -> Settings:
        if (client_cert is None) != (client_key is None):
            raise ValueError("client_cert and client_key must be given together")
        if connections < 1:
            raise ValueError(f"connections must be at least 1, got {connections}")
        if reconnect_timeout is not None and reconnect_timeout < 0:
            raise ValueError(f"reconnect_timeout must be positive or None, got {reconnect_timeout}")
        credentials = None
        # Passing any certificate is an unambiguous request for TLS.
        if tls or ca_cert is not None or client_cert is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=ca_cert, private_key=client_key, certificate_chain=client_cert
            )
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        options = dict[str, str | int](CHANNEL_OPTIONS)
        options.update(channel_options or ())  # the caller's options win
        return cls(
            addr,
            credentials,
            metadata,
            timeout,
            tuple(options.items()),
            connections,
            reconnect_timeout,
        )

    def sync_channel(self) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(self.target, options=self.options)
        return grpc.secure_channel(self.target, self.credentials, options=self.options)

    def aio_channel(self) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(self.target, options=self.options)
        return grpc.aio.secure_channel(self.target, self.credentials, options=self.options)


def queue_config(
    on_enqueue: str | None,
    on_failure: str | None,
    visibility_timeout_ms: int | None,
    max_attempts: int | None = None,
    retry_backoff: str | None = None,
) -> admin_pb2.QueueConfig:
    # Empty strings and 0 are the wire's "not set": the broker applies its defaults.
    return admin_pb2.QueueConfig(
        on_enqueue_script=on_enqueue or "",
        on_failure_script=on_failure or "",
        visibility_timeout_ms=visibility_timeout_ms or 0,
        max_attempts=max_attempts or 0,
        retry_backoff=retry_backoff or "",
    )


def update_queue_request(
    name: str,
    on_enqueue: str | None,
    on_failure: str | None,
    visibility_timeout_ms: int | None,
    max_attempts: int | None,
    retry_backoff: str | None,
) -> admin_pb2.UpdateQueueRequest:
    """Only the arguments given (not None) change; "" clears a script."""
    given = {
        "on_enqueue_script": on_enqueue,
        "on_failure_script": on_failure,
        "visibility_timeout_ms": visibility_timeout_ms,
        "max_attempts": max_attempts,
        "retry_backoff": retry_backoff,
    }
    changes = {field: value for field, value in given.items() if value is not None}
    if not changes:
        raise ValueError("update_queue: give at least one setting to change")
    return admin_pb2.UpdateQueueRequest(
        queue=name,
        config=admin_pb2.QueueConfig(**changes),  # type: ignore[arg-type]
        update_mask=list(changes),
    )


# The broker's largest peek page; `peek_all` asks for full pages so that walking a
# queue costs as few calls as possible. (Larger limits are capped by the broker.)
MAX_PEEK_LIMIT: Final = 1000


def peek_request(
    queue: str,
    limit: int | None,
    after_id: str | None,
    fairness_key: str | None,
    state: str | None = None,
) -> admin_pb2.PeekMessagesRequest:
    # 0 and "" are the wire's "not set": the broker's default page size (20), from the
    # start of the queue, every fairness key, every state.
    if state is not None and state not in MESSAGE_STATES:
        raise ValueError(f"state must be one of {', '.join(MESSAGE_STATES)}, got {state!r}")
    return admin_pb2.PeekMessagesRequest(
        queue=queue,
        limit=limit or 0,
        after_id=after_id or "",
        fairness_key=fairness_key or "",
        state=MESSAGE_STATES[state] if state is not None else 0,  # type: ignore[arg-type]
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
