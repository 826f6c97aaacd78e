"""Authorization for RPC handlers: who is calling, and may they touch this queue?

The auth interceptor (`fila.server.auth`) authenticates each call and binds its
`Caller` for the duration of the handler; with auth off nothing is bound and
everything is allowed. Handlers never parse credentials; they use this API:

    permits(kind, queue) -> bool       per-item check in batch and stream calls
    screen(kind, items, queue_of)      -> (permitted items, merge): `merge(results)` puts
                                       a PermissionDenied back at each refused position
    require(kind, queue)               raises PermissionDenied (a BrokerError)
    denied(kind, queue)                the PermissionDenied to put in an item's result
    may_see(queue) -> bool             whether ListQueues shows the queue to the caller
    may_manage_keys(key_id) -> bool    whether key management could be granted (cluster
                                       mode reads etcd only then)
    on_key_lost(stop) -> unsubscribe   `stop(reason)` runs once if the caller's key is
                                       revoked or expires while the call is open
    require_key()                      raises Unauthenticated if that already happened
    current() -> Caller | None         the caller itself (None when auth is off)

Unary calls whose request names one queue are checked centrally, before the
handler runs, from `RULES` below; so are calls that need a permission on every
queue (`*`) and calls reserved to superadmins. The handler only checks where the
table says `EACH_ITEM` (batch and stream requests, where each item names its own
queue: an item outside the ACL gets `PERMISSION_DENIED` in its own result and the
others proceed) or `HANDLER` (ListQueues filtering, key management).

A batch handler screens its items, so the broker never sees a refused one:

    items, merge = access.screen(Kind.PRODUCE, request.messages, lambda m: m.queue)
    results, committed = broker.enqueue(items)
    results = merge(results)       # request order, PermissionDenied where refused

A stream handler ends its stream with UNAUTHENTICATED when the key goes away,
either at once from a callback (a consumer stream) or at its next request:

    unsubscribe = access.on_key_lost(lambda reason: delivery.detach_consumer(consumer, reason))
    try: ... finally: unsubscribe()

    async for request in requests:
        access.require_key()

A method missing from `RULES` is reserved to superadmins, so a new RPC is closed
until someone decides who may call it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, TypeVar

from fila.core.errors import BrokerError, PermissionDenied, Unauthenticated, clip
from fila.security.acl import Kind
from fila.security.keyring import Caller

__all__ = [
    "RULES",
    "Caller",
    "Kind",
    "Rule",
    "Scope",
    "bind",
    "current",
    "denied",
    "may_manage_keys",
    "may_see",
    "on_key_lost",
    "permits",
    "require",
    "require_key",
    "rule_for",
    "screen",
]

_caller: ContextVar[Caller | None] = ContextVar("fila_caller", default=None)


def bind(caller: Caller) -> None:
    """Makes `caller` the current one for the rest of this RPC (the interceptor's job).

    grpc.aio runs each RPC in its own task, whose context is a copy, so the
    binding ends with the RPC and never reaches another call."""
    _caller.set(caller)


def current() -> Caller | None:
    return _caller.get()


def permits(kind: Kind, queue: str) -> bool:
    caller = _caller.get()
    return caller is None or caller.permits(kind, queue)


def denied(kind: Kind, queue: str) -> PermissionDenied:
    return _denial(_caller.get(), kind, queue)


def _denial(caller: Caller | None, kind: Kind, queue: str) -> PermissionDenied:
    who = "this API key" if caller is None else caller.describe()
    return PermissionDenied(f'{who} has no {kind.value} permission on queue "{clip(queue)}"')


def require(kind: Kind, queue: str) -> None:
    if not permits(kind, queue):
        raise denied(kind, queue)


Item = TypeVar("Item")
Result = TypeVar("Result")


def screen(
    kind: Kind, items: Sequence[Item], queue_of: Callable[[Item], str]
) -> tuple[Sequence[Item], Callable[[Sequence[Result]], list[Result | PermissionDenied]]]:
    """Splits a batch into the items the caller may touch, and a `merge` that takes
    their results (in order) and returns one result per original item, in request
    order, with a PermissionDenied for each refused one."""
    caller = _caller.get()
    if caller is None or caller.is_superadmin:
        return items, list
    decided: dict[str, PermissionDenied | None] = {}  # per queue: items name few
    refused: dict[int, PermissionDenied] = {}
    for index, item in enumerate(items):
        queue = queue_of(item)
        if queue in decided:
            denial = decided[queue]
        else:
            denial = decided[queue] = (
                None if caller.permits(kind, queue) else _denial(caller, kind, queue)
            )
        if denial is not None:
            refused[index] = denial
    if not refused:
        return items, list

    def merge(results: Sequence[Result]) -> list[Result | PermissionDenied]:
        permitted = iter(results)
        return [refused[i] if i in refused else next(permitted) for i in range(len(items))]

    return [item for index, item in enumerate(items) if index not in refused], merge


def require_key() -> None:
    """Raises Unauthenticated if the caller's key was revoked or expired since the call
    began (for streams that check at each request)."""
    caller = _caller.get()
    if caller is not None and not caller.valid():
        raise Unauthenticated("API key revoked or expired")


def may_see(queue: str) -> bool:
    caller = _caller.get()
    return caller is None or caller.may_see(queue)


def may_manage_keys(key_id: str = "") -> bool:
    """Whether the Keyring could grant the caller a key-management call (on `key_id`):
    superadmins, keys holding an admin permission to delegate, and a key reading its
    own ACL. False means it will refuse, so a node need not read etcd first."""
    caller = _caller.get()
    return (
        caller is None
        or caller.is_superadmin
        or bool(caller.admin_patterns())
        or (bool(key_id) and caller.key_id == key_id)
    )


def on_key_lost(stop: Callable[[BrokerError], None]) -> Callable[[], None]:
    """Calls `stop(reason)` (reason: an UNAUTHENTICATED error) once, on the event
    loop, if the caller's key is revoked or expires; returns the function that
    cancels this. A no-op with auth off or for the bootstrap key."""
    caller = _caller.get()
    if caller is None:
        return _nothing
    lost = caller.key_lost()

    def fire(done: Any) -> None:
        stop(done.result())

    def unsubscribe() -> None:
        lost.remove_done_callback(fire)

    lost.add_done_callback(fire)
    return unsubscribe


def _nothing() -> None:
    return None


class Scope(Enum):
    QUEUE = "queue"  # the request field `field` names the queue; checked before the handler
    EACH_ITEM = "each_item"  # every item names a queue; the handler checks each (permits)
    EVERY_QUEUE = "every_queue"  # no single queue (runtime config): `kind` on "*"
    SUPERADMIN = "superadmin"
    HANDLER = "handler"  # any valid key; the handler decides (ListQueues, keys and ACLs)


@dataclass(frozen=True, slots=True)
class Rule:
    scope: Scope
    kind: Kind | None = None
    field: str = ""

    def check(self, caller: Caller, request: object) -> PermissionDenied | None:
        """The refusal for a unary request, or None; EACH_ITEM and HANDLER pass here."""
        if caller.is_superadmin:
            return None
        if self.scope is Scope.QUEUE:
            assert self.kind is not None
            # Only unary requests carry a queue here (a test holds RULES to that).
            queue = getattr(request, self.field, None)
            if queue is None:
                return None  # undecodable (rpc.BadRequest): its handler refuses it untouched
            if not caller.permits(self.kind, queue):
                return _denial(caller, self.kind, queue)
        elif self.scope is Scope.EVERY_QUEUE:
            assert self.kind is not None
            if not caller.permits_everywhere(self.kind):
                return PermissionDenied(
                    f'{caller.describe()} needs {self.kind.value} permission on "*" for this call'
                )
        elif self.scope is Scope.SUPERADMIN:
            return PermissionDenied(f"{caller.describe()} is not a superadmin")
        return None


def _queue(kind: Kind, field: str = "queue") -> Rule:
    return Rule(Scope.QUEUE, kind, field)


def _each(kind: Kind) -> Rule:
    return Rule(Scope.EACH_ITEM, kind)


_HANDLER: Final = Rule(Scope.HANDLER)
_SUPERADMIN: Final = Rule(Scope.SUPERADMIN)

# Every FilaService and FilaAdmin method (SPEC 1 and 3); a test checks it covers the protos.
RULES: Final[Mapping[str, Rule]] = {
    "/fila.v1.FilaService/Enqueue": _queue(Kind.PRODUCE),
    "/fila.v1.FilaService/EnqueueBatch": _each(Kind.PRODUCE),
    "/fila.v1.FilaService/StreamEnqueue": _each(Kind.PRODUCE),
    "/fila.v1.FilaService/Consume": _queue(Kind.CONSUME),
    "/fila.v1.FilaService/StreamConsume": _each(Kind.CONSUME),  # queue in the first request
    "/fila.v1.FilaService/Ack": _queue(Kind.CONSUME),
    "/fila.v1.FilaService/Nack": _queue(Kind.CONSUME),
    "/fila.v1.FilaService/AckBatch": _each(Kind.CONSUME),
    "/fila.v1.FilaService/NackBatch": _each(Kind.CONSUME),
    "/fila.v1.FilaService/ExtendLease": _queue(Kind.CONSUME),
    "/fila.v1.FilaAdmin/CreateQueue": _queue(Kind.ADMIN, "name"),
    "/fila.v1.FilaAdmin/DeleteQueue": _queue(Kind.ADMIN),
    "/fila.v1.FilaAdmin/GetStats": _queue(Kind.ADMIN),
    "/fila.v1.FilaAdmin/Redrive": _queue(Kind.ADMIN, "dlq_queue"),
    "/fila.v1.FilaAdmin/PeekMessages": _queue(Kind.ADMIN),
    "/fila.v1.FilaAdmin/PurgeQueue": _queue(Kind.ADMIN),
    "/fila.v1.FilaAdmin/GetQueue": _queue(Kind.ADMIN),
    "/fila.v1.FilaAdmin/UpdateQueue": _queue(Kind.ADMIN),
    "/fila.v1.FilaAdmin/ListQueues": _HANDLER,  # filtered by may_see
    # Runtime config is global (throttle keys span queues): admin on "*".
    "/fila.v1.FilaAdmin/SetConfig": Rule(Scope.EVERY_QUEUE, Kind.ADMIN),
    "/fila.v1.FilaAdmin/GetConfig": Rule(Scope.EVERY_QUEUE, Kind.ADMIN),
    "/fila.v1.FilaAdmin/ListConfig": Rule(Scope.EVERY_QUEUE, Kind.ADMIN),
    # The cluster's nodes and how many queues each owns: an operator's view, like config.
    "/fila.v1.FilaAdmin/ClusterStatus": Rule(Scope.EVERY_QUEUE, Kind.ADMIN),
    # Forgetting a node changes where every queue's replicas live: superadmins only.
    "/fila.v1.FilaAdmin/RemoveNode": _SUPERADMIN,
    # Key management: the Keyring decides (superadmins; delegation for ACLs).
    "/fila.v1.FilaAdmin/CreateApiKey": _HANDLER,
    "/fila.v1.FilaAdmin/RevokeApiKey": _HANDLER,
    "/fila.v1.FilaAdmin/ListApiKeys": _HANDLER,
    "/fila.v1.FilaAdmin/SetAcl": _HANDLER,
    "/fila.v1.FilaAdmin/GetAcl": _HANDLER,
}


def rule_for(method: str) -> Rule:
    return RULES.get(method, _SUPERADMIN)
