"""Plain, immutable records returned by the clients.

Callers get these instead of protobuf objects so that they can hash, compare and
pickle results, and so that a change in the wire schema does not ripple into
application code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from fila.v1 import admin_pb2, messages_pb2
from fila.wire import UNLIMITED_ATTEMPTS

__all__ = [
    "Acl",
    "AclPermission",
    "ApiKeyInfo",
    "ConfigEntry",
    "ConfigListing",
    "CreatedApiKey",
    "EnqueueItem",
    "FairnessKeyStats",
    "Message",
    "PeekPage",
    "PeekedState",
    "QueueConfig",
    "QueueDetails",
    "QueueInfo",
    "QueueStats",
    "ThrottleKeyStats",
]


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _time(stamp: Timestamp, present: bool) -> datetime | None:
    # An unset Timestamp decodes as the epoch; None says "never happened" instead.
    # What Timestamp.ToDatetime computes (to the microsecond), at half its cost: this
    # runs twice per delivered message.
    if not present:
        return None
    return _EPOCH + timedelta(seconds=stamp.seconds, microseconds=stamp.nanos // 1000)


@dataclass(frozen=True, slots=True)
class Message:
    """A message as delivered by `consume` or a `Worker` (leased) or shown by `peek`.

    `fairness_key`, `weight` and `throttle_keys` are what the queue's `on_enqueue`
    hook assigned; `attempt_count` counts failed deliveries so far (0 on the first);
    `enqueued_at` and `leased_at` are the broker's times (`leased_at` None unless
    leased)."""

    id: str
    queue: str
    headers: dict[str, str]
    payload: bytes
    fairness_key: str
    weight: int
    throttle_keys: tuple[str, ...]
    attempt_count: int
    enqueued_at: datetime | None
    leased_at: datetime | None
    # Why and when it last failed (the last nack's error, or "visibility timeout
    # expired"), and when it was dead-lettered; kept across redrive. "" / None: never.
    last_error: str = ""
    last_failed_at: datetime | None = None
    dead_lettered_at: datetime | None = None

    @classmethod
    def from_proto(cls, msg: messages_pb2.Message) -> Message:
        """The record from the broker's `Message`."""
        # Per delivered message, so kept lean: positional arguments, and no copies of
        # empty maps and lists (figures: docs/benchmarks.md).
        meta, times = msg.metadata, msg.timestamps
        headers, throttle_keys = msg.headers, meta.throttle_keys
        return cls(
            msg.id,
            meta.queue_id,
            dict(headers) if headers else {},
            msg.payload,
            meta.fairness_key,
            meta.weight,
            tuple(throttle_keys) if throttle_keys else (),
            meta.attempt_count,
            _time(times.enqueued_at, times.HasField("enqueued_at")),
            _time(times.leased_at, times.HasField("leased_at")),
            meta.last_error,
            _time(meta.last_failed_at, meta.HasField("last_failed_at")),
            _time(meta.dead_lettered_at, meta.HasField("dead_lettered_at")),
        )

    def json(self) -> Any:
        """The payload parsed as JSON (as `enqueue_json` stores it); ValueError if it
        is not JSON."""
        return json.loads(self.payload)


# A peeked message's state, as `peek(state=...)` takes it and `PeekedState.state` says.
MESSAGE_STATES: dict[str, int] = {
    "ready": admin_pb2.READY,
    "delayed": admin_pb2.DELAYED,
    "leased": admin_pb2.LEASED,
}
_STATE_NAMES = {number: name for name, number in MESSAGE_STATES.items()}


@dataclass(frozen=True, slots=True)
class PeekedState:
    """A peeked message's state: "ready", "delayed" (with `ready_at`) or "leased"
    (with `lease_deadline`, when the lease runs out unless settled or extended)."""

    state: str
    ready_at: datetime | None = None
    lease_deadline: datetime | None = None

    @classmethod
    def from_proto(cls, peeked: admin_pb2.PeekedState) -> PeekedState:
        """The record from the broker's `PeekedState`."""
        return cls(
            _STATE_NAMES.get(peeked.state, "unknown"),
            _time(peeked.ready_at, peeked.HasField("ready_at")),
            _time(peeked.lease_deadline, peeked.HasField("lease_deadline")),
        )


@dataclass(frozen=True, slots=True)
class PeekPage:
    """One page of `peek`: messages in id order, and where the next page starts.

    `next_after_id` is the `after_id` of the next page, or None when this page
    reached the end of the queue. `states[i]` is `messages[i]`'s state (empty from a
    broker that does not report states).
    """

    messages: tuple[Message, ...]
    next_after_id: str | None
    states: tuple[PeekedState, ...] = ()

    @classmethod
    def from_proto(cls, resp: admin_pb2.PeekMessagesResponse) -> PeekPage:
        """The record from the broker's `PeekMessagesResponse`."""
        return cls(
            tuple(Message.from_proto(m) for m in resp.messages),
            resp.next_after_id or None,
            tuple(PeekedState.from_proto(s) for s in resp.states),
        )


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """A queue's configuration in force: its hooks ("" = none), visibility timeout, and
    the retry policy used without an `on_failure` hook (`max_attempts` None: no limit;
    `retry_backoff` "exponential", "none" or "fixed:<duration>")."""

    on_enqueue: str
    on_failure: str
    visibility_timeout_ms: int
    max_attempts: int | None
    retry_backoff: str

    @classmethod
    def from_proto(cls, config: admin_pb2.QueueConfig) -> QueueConfig:
        """The record from the broker's `QueueConfig`."""
        attempts = config.max_attempts
        return cls(
            config.on_enqueue_script,
            config.on_failure_script,
            config.visibility_timeout_ms,
            None if attempts in (0, UNLIMITED_ATTEMPTS) else attempts,
            config.retry_backoff,
        )


@dataclass(frozen=True, slots=True)
class QueueDetails:
    """`get_queue`: the queue's name, configuration and DLQ (None for a DLQ itself)."""

    name: str
    config: QueueConfig
    dlq: str | None

    @classmethod
    def from_proto(cls, resp: admin_pb2.GetQueueResponse) -> QueueDetails:
        """The record from the broker's `GetQueueResponse`."""
        return cls(resp.name, QueueConfig.from_proto(resp.config), resp.dlq or None)


@dataclass(frozen=True, slots=True)
class EnqueueItem:
    """One message for `enqueue_many`: the arguments `enqueue` takes, as a record.

    `delay` (a `timedelta` or seconds) makes the message ready only that long after
    it is stored, as a scheduled job."""

    headers: Mapping[str, str] | None
    payload: bytes | str
    delay: timedelta | float | None = None


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """One queue of `list_queues`: its depth (ready and delayed), messages in flight
    (leased) and consumers connected."""

    name: str
    depth: int
    in_flight: int
    active_consumers: int

    @classmethod
    def from_proto(cls, info: admin_pb2.QueueInfo) -> QueueInfo:
        """The record from the broker's `QueueInfo`."""
        return cls(info.name, info.depth, info.in_flight, info.active_consumers)


@dataclass(frozen=True, slots=True)
class FairnessKeyStats:
    """One fairness key of `QueueStats.per_key`: its pending messages, its DRR deficit
    and weight."""

    key: str
    pending_count: int
    current_deficit: int
    weight: int
    # Deliveries of this key since the broker started: its share of the queue's
    # `delivered_total` is the share DRR gave it.
    delivered_total: int = 0


@dataclass(frozen=True, slots=True)
class ThrottleKeyStats:
    """One throttle key of `QueueStats.per_throttle`: its token bucket's tokens now,
    its rate per second and its burst."""

    key: str
    tokens: float
    rate_per_second: float
    burst: float


@dataclass(frozen=True, slots=True)
class QueueStats:
    """`get_stats`: a queue's depth (ready and delayed) and messages in flight
    (leased), its fairness and throttle keys, and counters since the broker started."""

    depth: int
    in_flight: int
    active_fairness_keys: int
    active_consumers: int
    quantum: int
    per_key: tuple[FairnessKeyStats, ...]
    per_throttle: tuple[ThrottleKeyStats, ...]
    # Counters since the broker started (they restart at 0 with it): two samples
    # a known time apart give rates without a metrics system.
    enqueued_total: int = 0
    delivered_total: int = 0
    acked_total: int = 0
    nacked_total: int = 0
    expired_total: int = 0
    dead_lettered_total: int = 0
    # `depth` = ready + delayed; leased messages are `in_flight`.
    delayed: int = 0
    # Run-time failures of the queue's Lua hooks, the last one's text and time.
    hook_errors_total: int = 0
    last_hook_error: str = ""
    last_hook_error_at: datetime | None = None

    @property
    def ready(self) -> int:
        """Messages a consumer could be given now (or once their throttle allows)."""
        return self.depth - self.delayed

    @classmethod
    def from_proto(cls, resp: admin_pb2.GetStatsResponse) -> QueueStats:
        """The record from the broker's `GetStatsResponse`."""
        return cls(
            depth=resp.depth,
            in_flight=resp.in_flight,
            active_fairness_keys=resp.active_fairness_keys,
            active_consumers=resp.active_consumers,
            quantum=resp.quantum,
            per_key=tuple(
                FairnessKeyStats(
                    s.key, s.pending_count, s.current_deficit, s.weight, s.delivered_total
                )
                for s in resp.per_key_stats
            ),
            per_throttle=tuple(
                ThrottleKeyStats(s.key, s.tokens, s.rate_per_second, s.burst)
                for s in resp.per_throttle_stats
            ),
            enqueued_total=resp.enqueued_total,
            delivered_total=resp.delivered_total,
            acked_total=resp.acked_total,
            nacked_total=resp.nacked_total,
            expired_total=resp.expired_total,
            dead_lettered_total=resp.dead_lettered_total,
            delayed=resp.delayed,
            hook_errors_total=resp.hook_errors_total,
            last_hook_error=resp.last_hook_error,
            last_hook_error_at=_time(resp.last_hook_error_at, resp.HasField("last_hook_error_at")),
        )


@dataclass(frozen=True, slots=True)
class ConfigEntry:
    """One runtime configuration value."""

    key: str
    value: str


@dataclass(frozen=True, slots=True)
class ConfigListing:
    """`list_config`: the values found (the broker may cut a long listing short) and
    how many keys matched in all."""

    entries: tuple[ConfigEntry, ...]
    total_count: int

    @classmethod
    def from_proto(cls, resp: admin_pb2.ListConfigResponse) -> ConfigListing:
        """The record from the broker's `ListConfigResponse`."""
        return cls(tuple(ConfigEntry(e.key, e.value) for e in resp.entries), resp.total_count)


# API keys and ACLs.


def _ms_time(ms: int) -> datetime | None:
    # 0 is the wire's "never" for expires_at_ms.
    return datetime.fromtimestamp(ms / 1000, tz=UTC) if ms else None


@dataclass(frozen=True, slots=True)
class CreatedApiKey:
    """`key` is the plaintext secret, returned only by `create_api_key`: the broker keeps
    a hash and cannot show it again. Kept out of `repr` so it does not end up in logs."""

    key_id: str
    key: str = field(repr=False)
    is_superadmin: bool = False


@dataclass(frozen=True, slots=True)
class ApiKeyInfo:
    """One key of `list_api_keys` (never its secret)."""

    key_id: str
    name: str
    created_at: datetime | None
    expires_at: datetime | None  # None: never expires
    is_superadmin: bool

    @classmethod
    def from_proto(cls, info: admin_pb2.ApiKeyInfo) -> ApiKeyInfo:
        """The record from the broker's `ApiKeyInfo`."""
        return cls(
            info.key_id,
            info.name,
            _ms_time(info.created_at_ms),
            _ms_time(info.expires_at_ms),
            info.is_superadmin,
        )


@dataclass(frozen=True, slots=True)
class AclPermission:
    """One permission of an API key: `kind` is "produce", "consume" or "admin";
    `pattern` is `"*"`, a queue name or `"prefix.*"`."""

    kind: str
    pattern: str

    @classmethod
    def parse(cls, text: str) -> AclPermission:
        """`"produce:orders.*"` -> AclPermission("produce", "orders.*"); the broker
        validates kind and pattern."""
        kind, sep, pattern = text.partition(":")
        if not sep or not kind or not pattern:
            raise ValueError(f'permission "{text}" is not KIND:PATTERN (e.g. produce:orders)')
        return cls(kind, pattern)

    def __str__(self) -> str:
        return f"{self.kind}:{self.pattern}"


@dataclass(frozen=True, slots=True)
class Acl:
    """`get_acl`: a key's permissions (a superadmin needs none)."""

    key_id: str
    permissions: tuple[AclPermission, ...]
    is_superadmin: bool

    @classmethod
    def from_proto(cls, resp: admin_pb2.GetAclResponse) -> Acl:
        """The record from the broker's `GetAclResponse`."""
        return cls(
            resp.key_id,
            tuple(AclPermission(p.kind, p.pattern) for p in resp.permissions),
            resp.is_superadmin,
        )
