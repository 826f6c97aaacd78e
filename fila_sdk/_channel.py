"""What the sync and async clients share: connection settings and error mapping.

Both clients are thin shells over the generated stubs; everything that decides
behaviour (credentials, auth metadata, which exception a failure becomes) lives
here once, so the two cannot drift apart (the requests themselves are built in
`fila_sdk._calls`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Final, cast

import grpc
import grpc.aio

from fila.v1 import service_pb2
from fila.wire import ERROR_KIND_METADATA_KEY, ErrorKind

from .errors import (
    ApiKeyNotFoundError,
    ClientClosedError,
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


def call_error(err: grpc.RpcError, rpc: str, closed: bool) -> FilaError:
    """What a failed call of `rpc` raises: `ClientClosedError` if the client was closed
    meanwhile (closing its channel ends the calls in flight), else `map_rpc_error`."""
    return ClientClosedError() if closed else map_rpc_error(err, rpc)


def not_ready(target: str, timeout: float) -> UnavailableError:
    """What `wait_ready` raises when the broker is not reached in time."""
    return UnavailableError(
        f"cannot reach broker at {target} within {timeout:g}s", grpc.StatusCode.UNAVAILABLE
    )


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
