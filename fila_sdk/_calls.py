"""Every request the clients make, written once for `Client` and `AsyncClient`.

A client method asks a builder here for a `Call`: the request, and what the answer
becomes (a record of `fila_sdk.types`, an id, per-item outcomes) or what an error
becomes when the method absorbs one. The client only sends it, on its own channel
(`Client._call` blocks on a gRPC sync channel, `AsyncClient._call` awaits a `grpc.aio`
one), and a failed call becomes the same `FilaError` either way
(`fila_sdk._channel.call_error`). So a new RPC is one builder here and a one-line
method on each client.

The blocking client keeps a channel of its own rather than running `AsyncClient` on a
private loop thread for unary calls: the hand-off to that thread and back adds a large
share of a round trip to every call (docs/benchmarks.md, "fila_sdk"). Streams are
another matter: they need a reader while callers block, so `Client.enqueue` and the
`Worker` do run the async machinery there (`fila_sdk._loop`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Generic, TypeVar

import grpc
from google.protobuf.message import Message as ProtoMessage

from fila.v1 import admin_pb2, service_pb2

from ._channel import milliseconds
from .batching import (
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
from .errors import FilaError, QueueAlreadyExistsError
from .types import (
    MESSAGE_STATES,
    Acl,
    AclPermission,
    ApiKeyInfo,
    ConfigListing,
    CreatedApiKey,
    PeekPage,
    QueueConfig,
    QueueDetails,
    QueueInfo,
    QueueStats,
)

Resp = TypeVar("Resp", bound=ProtoMessage)
R = TypeVar("R")

# The broker's largest peek page; `peek_all` asks for full pages so that walking a
# queue costs as few calls as possible. (Larger limits are capped by the broker.)
MAX_PEEK_LIMIT: Final = 1000

_ADMIN_FILE: Final = admin_pb2.DESCRIPTOR


@dataclass(frozen=True, slots=True)
class Call(Generic[Resp, R]):
    """One unary RPC: `request`, what its answer becomes (`answer`), and, for a method
    that turns an error into a result, `recover` (which returns the result or raises)."""

    request: ProtoMessage
    answer: Callable[[Resp], R]
    recover: Callable[[FilaError], R] | None = None

    @property
    def method(self) -> str:
        """The RPC's name ("GetStats"): every request type is named after its RPC."""
        return type(self.request).__name__.removesuffix("Request")

    @property
    def admin(self) -> bool:
        """Whether the RPC is `FilaAdmin`'s (else `FilaService`'s)."""
        return self.request.DESCRIPTOR.file is _ADMIN_FILE

    def failed(self, error: FilaError) -> R:
        """What the call becomes after `error`: `recover`'s result, else the error."""
        if self.recover is None:
            raise error
        return self.recover(error)


def _nothing(response: ProtoMessage) -> None:
    return None


class BatchSettlement:
    """Whether the broker has `AckBatch` / `NackBatch`: until it answers UNIMPLEMENTED
    (a broker that predates them), after which a client settles one call per item."""

    __slots__ = ("available",)

    def __init__(self) -> None:
        self.available = True

    def call(
        self, request: service_pb2.AckBatchRequest | service_pb2.NackBatchRequest
    ) -> Call[Any, list[FilaError | None] | None]:
        """The batch call: per item None (settled) or its error, a call that failed as a
        whole failing each item; None if the broker has no batch settlement (then send
        `one_by_one(request)`)."""
        count = len(settlements(request))
        rpc = "Ack" if isinstance(request, service_pb2.AckBatchRequest) else "Nack"

        def recover(error: FilaError) -> list[FilaError | None] | None:
            if error.code == grpc.StatusCode.UNIMPLEMENTED:
                self.available = False
                return None
            return [error] * count

        return Call(request, lambda response: settle_results(response.results, rpc), recover)


def settlements(
    request: service_pb2.AckBatchRequest | service_pb2.NackBatchRequest,
) -> Sequence[service_pb2.AckRequest | service_pb2.NackRequest]:
    if isinstance(request, service_pb2.AckBatchRequest):
        return request.acks
    return request.nacks


def one_by_one(
    request: service_pb2.AckBatchRequest | service_pb2.NackBatchRequest,
) -> list[Call[Any, None]]:
    """The unary calls that settle a batch's items, against a broker without batches."""
    return [Call(item, _nothing) for item in settlements(request)]


def ack_batches(queue: str, message_ids: Iterable[str]) -> Iterator[service_pb2.AckBatchRequest]:
    """`ack_many`'s requests, each within the broker's batch limits."""
    ids = list(message_ids)
    return (ack_batch_request(queue, ids, span) for span in chunks([0] * len(ids)))


def nack_batches(
    queue: str, items: Iterable[NackItem], error: str
) -> Iterator[service_pb2.NackBatchRequest]:
    """`nack_many`'s requests: an item is a message id (nacked with `error`) or a
    (message id, error) pair."""
    listed = list(items)
    return (nack_batch_request(queue, listed, error, span) for span in chunks([0] * len(listed)))


def ack_batch(items: Iterable[tuple[str, str]]) -> service_pb2.AckBatchRequest:
    """One `AckBatch` for coalesced (queue, message id) acks."""
    request = service_pb2.AckBatchRequest()
    add = request.acks.add
    for queue, message_id in items:
        add(queue=queue, message_id=message_id)
    return request


def nack_batch(items: Iterable[tuple[str, str, str]]) -> service_pb2.NackBatchRequest:
    """One `NackBatch` for coalesced (queue, message id, error) nacks."""
    request = service_pb2.NackBatchRequest()
    add = request.nacks.add
    for queue, message_id, error in items:
        add(queue=queue, message_id=message_id, error=error)
    return request


def enqueue_batches(
    queue: str, items: Iterable[EnqueueLike]
) -> list[Call[service_pb2.EnqueueBatchResponse, list[str | FilaError]]]:
    """`enqueue_many`'s calls, each within the broker's batch limits; a call that fails
    as a whole fails each of its items. Every item is checked before any is sent (see
    `fila_sdk.batching.entries`)."""
    batch = entries(items)
    calls = []
    for span in chunks([entry_bytes(e) for e in batch]):

        def recover(error: FilaError, count: int = len(span)) -> list[str | FilaError]:
            return [error] * count

        request = enqueue_batch_request(queue, batch, span)
        calls.append(Call(request, _enqueue_answer, recover))
    return calls


def _enqueue_answer(response: service_pb2.EnqueueBatchResponse) -> list[str | FilaError]:
    return enqueue_results(response.results)


def ack(queue: str, message_id: str) -> Call[service_pb2.AckResponse, None]:
    return Call(service_pb2.AckRequest(queue=queue, message_id=message_id), _nothing)


def nack(queue: str, message_id: str, error: str) -> Call[service_pb2.NackResponse, None]:
    request = service_pb2.NackRequest(
        queue=queue, message_id=message_id, error=bounded_error(error)
    )
    return Call(request, _nothing)


def extend_lease(
    queue: str, message_id: str, extend: timedelta | float | None
) -> Call[service_pb2.ExtendLeaseResponse, datetime]:
    request = service_pb2.ExtendLeaseRequest(
        queue=queue, message_id=message_id, extend_ms=milliseconds(extend, "extend")
    )
    return Call(request, lambda response: response.deadline.ToDatetime(tzinfo=UTC))


def consume_request(
    queue: str, prefetch: int | None, max_batch: int | None
) -> service_pb2.ConsumeRequest:
    return service_pb2.ConsumeRequest(
        queue=queue, prefetch=_count(prefetch, "prefetch"), max_batch=_count(max_batch, "max_batch")
    )


def _count(value: int | None, what: str) -> int:
    """An optional positive count for the wire (0 = the broker's default)."""
    if value is None:
        return 0
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    return value


# Admin.


def queue_config(
    on_enqueue: str | None,
    on_failure: str | None,
    visibility_timeout_ms: int | None,
    max_attempts: int | None,
    retry_backoff: str | None,
) -> admin_pb2.QueueConfig:
    """A new queue's configuration: None is the wire's "not set" (empty strings and
    0), for which the broker applies its defaults."""
    return admin_pb2.QueueConfig(
        on_enqueue_script=on_enqueue or "",
        on_failure_script=on_failure or "",
        visibility_timeout_ms=visibility_timeout_ms or 0,
        max_attempts=max_attempts or 0,
        retry_backoff=retry_backoff or "",
    )


def create_queue(
    name: str, config: admin_pb2.QueueConfig, exist_ok: bool
) -> Call[admin_pb2.CreateQueueResponse, str]:
    """With `exist_ok`, a queue of that name already existing answers its name."""

    def recover(error: FilaError) -> str:
        if exist_ok and isinstance(error, QueueAlreadyExistsError):
            return name
        raise error

    request = admin_pb2.CreateQueueRequest(name=name, config=config)
    return Call(request, lambda response: response.queue_id, recover)


def delete_queue(name: str) -> Call[admin_pb2.DeleteQueueResponse, None]:
    return Call(admin_pb2.DeleteQueueRequest(queue=name), _nothing)


def get_queue(name: str) -> Call[admin_pb2.GetQueueResponse, QueueDetails]:
    return Call(admin_pb2.GetQueueRequest(queue=name), QueueDetails.from_proto)


def update_queue(
    request: admin_pb2.UpdateQueueRequest,
) -> Call[admin_pb2.UpdateQueueResponse, QueueConfig]:
    """`UpdateQueue` of `update_queue_request(...)`: the configuration in force after."""
    return Call(request, lambda response: QueueConfig.from_proto(response.config))


def update_queue_request(
    name: str,
    on_enqueue: str | None,
    on_failure: str | None,
    visibility_timeout_ms: int | None,
    max_attempts: int | None,
    retry_backoff: str | None,
) -> admin_pb2.UpdateQueueRequest:
    """Only the arguments given (not None) change; "" clears a script. (The dashboard
    sends this request too.)"""
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


def list_queues() -> Call[admin_pb2.ListQueuesResponse, list[QueueInfo]]:
    return Call(
        admin_pb2.ListQueuesRequest(),
        lambda response: [QueueInfo.from_proto(q) for q in response.queues],
    )


def get_stats(queue: str) -> Call[admin_pb2.GetStatsResponse, QueueStats]:
    return Call(admin_pb2.GetStatsRequest(queue=queue), QueueStats.from_proto)


def set_config(key: str, value: str) -> Call[admin_pb2.SetConfigResponse, None]:
    return Call(admin_pb2.SetConfigRequest(key=key, value=value), _nothing)


def get_config(key: str) -> Call[admin_pb2.GetConfigResponse, str]:
    return Call(admin_pb2.GetConfigRequest(key=key), lambda response: response.value)


def list_config(prefix: str) -> Call[admin_pb2.ListConfigResponse, ConfigListing]:
    return Call(admin_pb2.ListConfigRequest(prefix=prefix), ConfigListing.from_proto)


def redrive(dlq_queue: str, count: int) -> Call[admin_pb2.RedriveResponse, int]:
    request = admin_pb2.RedriveRequest(dlq_queue=dlq_queue, count=count)
    return Call(request, lambda response: response.redriven)


def peek(
    queue: str,
    limit: int | None,
    after_id: str | None,
    fairness_key: str | None,
    state: str | None,
) -> Call[admin_pb2.PeekMessagesResponse, PeekPage]:
    # 0 and "" are the wire's "not set": the broker's default page size (20), from the
    # start of the queue, every fairness key, every state.
    if state is not None and state not in MESSAGE_STATES:
        raise ValueError(f"state must be one of {', '.join(MESSAGE_STATES)}, got {state!r}")
    request = admin_pb2.PeekMessagesRequest(
        queue=queue,
        limit=limit or 0,
        after_id=after_id or "",
        fairness_key=fairness_key or "",
        state=MESSAGE_STATES[state] if state is not None else 0,  # type: ignore[arg-type]
    )
    return Call(request, PeekPage.from_proto)


def purge(queue: str) -> Call[admin_pb2.PurgeQueueResponse, int]:
    return Call(admin_pb2.PurgeQueueRequest(queue=queue), lambda response: response.purged)


def create_api_key(
    name: str, superadmin: bool, expires_at: datetime | None
) -> Call[admin_pb2.CreateApiKeyResponse, CreatedApiKey]:
    # A naive datetime is local time, as datetime.timestamp() reads it; 0 means never.
    expires_at_ms = 0 if expires_at is None else int(expires_at.timestamp() * 1000)
    request = admin_pb2.CreateApiKeyRequest(
        name=name, expires_at_ms=expires_at_ms, is_superadmin=superadmin
    )
    return Call(request, lambda r: CreatedApiKey(r.key_id, r.key, r.is_superadmin))


def list_api_keys() -> Call[admin_pb2.ListApiKeysResponse, list[ApiKeyInfo]]:
    return Call(
        admin_pb2.ListApiKeysRequest(),
        lambda response: [ApiKeyInfo.from_proto(k) for k in response.keys],
    )


def revoke_api_key(key_id: str) -> Call[admin_pb2.RevokeApiKeyResponse, None]:
    return Call(admin_pb2.RevokeApiKeyRequest(key_id=key_id), _nothing)


def set_acl(
    key_id: str, permissions: Iterable[AclPermission | str]
) -> Call[admin_pb2.SetAclResponse, None]:
    """`permissions` as `AclPermission`s or "kind:pattern" strings."""
    parsed = [AclPermission.parse(p) if isinstance(p, str) else p for p in permissions]
    request = admin_pb2.SetAclRequest(
        key_id=key_id,
        permissions=[admin_pb2.AclPermission(kind=p.kind, pattern=p.pattern) for p in parsed],
    )
    return Call(request, _nothing)


def get_acl(key_id: str) -> Call[admin_pb2.GetAclResponse, Acl]:
    return Call(admin_pb2.GetAclRequest(key_id=key_id), Acl.from_proto)
