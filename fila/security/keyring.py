"""The one owner of API keys and ACLs in memory, and `Caller`, the key behind an RPC.

`Keyring` answers two questions on every authenticated call (which key is this,
and may it do that?) and carries out key management. Its state lives only here,
changed only by its methods on the event loop. A change is checked at once, handed to
the `KeyStore`, and applied in memory when the store has it, in the awaitable the RPC
awaits before answering: a revoked key stops working before the answer leaves, and a
write that fails (a disk error; etcd away, in cluster mode) changes nothing, so the
caller can retry it here and this node still agrees with what is stored.

Lookup is by SHA-256 digest, so a presented key is hashed once and found with one
dict lookup, whatever the number of keys; the stored digest is then compared with
`hmac.compare_digest`. The dict lookup compares digests of attacker-chosen input,
which tells an attacker nothing about any key's plaintext.

Who may manage what: superadmins (the bootstrap key and keys created with
`is_superadmin`) bypass ACLs and alone create, list and revoke keys. A key with
`admin` on some patterns may read and replace the ACL of a key only when the key
is not a superadmin and every permission the key holds lies inside those
patterns (so a tenant administrator can neither widen a key beyond its own
domain nor strip a grant made by someone else), and may grant only permissions
inside them. Any key may read its own ACL. With auth off there is no caller
(`None`) and everything is allowed.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Iterable
from enum import Enum

from fila.clock import Clock
from fila.core.errors import (
    ApiKeyNotFound,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)
from fila.security import apikeys
from fila.security.acl import Kind, Pattern, Permission, covers, may_delegate, parse_permissions
from fila.security.apikeys import ApiKeyRecord
from fila.security.keystore import KeyStore

log = logging.getLogger("fila.security")

BOOTSTRAP_NAME = "bootstrap"


class Refusal(Enum):
    """Why a presented credential does not authenticate; the value is the client's message."""

    MISSING = "missing API key: send metadata authorization: Bearer <key>"
    MALFORMED = "malformed authorization metadata: expected Bearer <key>"
    UNKNOWN = "unknown or revoked API key"
    EXPIRED = "API key expired"


# ACL decisions remembered per key (see `_KeyState.decisions`), at most this many.
_MAX_DECISIONS = 4096


class _KeyState:
    """One live key: its record, its ACL, and what open streams wait on.

    `decisions` remembers what the ACL answered for each (kind, queue) asked about, so
    a client calling on the same queues pays the pattern matching once; it is cleared
    whenever the ACL changes (`set_permissions`, the one way to change it)."""

    __slots__ = ("caller", "decisions", "lost", "permissions", "record", "timer")

    def __init__(self, record: ApiKeyRecord, permissions: tuple[Permission, ...]) -> None:
        self.record = record
        self.permissions = permissions
        self.decisions: dict[tuple[Kind, str], bool] = {}
        # Created on first use by a stream; resolved when the key is revoked or expires.
        self.lost: asyncio.Future[Unauthenticated] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.caller: Caller | None = None

    def set_permissions(self, permissions: tuple[Permission, ...]) -> None:
        self.permissions = permissions
        self.decisions.clear()

    def permits(self, kind: Kind, queue: str) -> bool:
        decisions = self.decisions
        decided = decisions.get((kind, queue))
        if decided is None:
            if len(decisions) >= _MAX_DECISIONS:
                decisions.clear()
            decided = decisions[(kind, queue)] = covers(self.permissions, kind, queue)
        return decided


class Caller:
    """The authenticated key behind one RPC. Reads its ACL live, so a `SetAcl`
    applies to the next check of a stream that is already open."""

    __slots__ = ("_keyring", "_state")

    def __init__(self, keyring: Keyring, state: _KeyState) -> None:
        self._keyring = keyring
        self._state = state

    @property
    def key_id(self) -> str:
        return self._state.record.key_id

    @property
    def name(self) -> str:
        return self._state.record.name

    @property
    def is_superadmin(self) -> bool:
        return self._state.record.is_superadmin

    @property
    def permissions(self) -> tuple[Permission, ...]:
        return self._state.permissions

    def describe(self) -> str:
        return f'API key "{self.name}" ({self.key_id})'

    def permits(self, kind: Kind, queue: str) -> bool:
        state = self._state
        return state.record.is_superadmin or state.permits(kind, queue)

    def permits_everywhere(self, kind: Kind) -> bool:
        """Holds `kind` on `*` (or is a superadmin): for operations on no single queue."""
        return self.is_superadmin or any(
            p.kind is kind and p.pattern.is_any for p in self._state.permissions
        )

    def may_see(self, queue: str) -> bool:
        """Any permission at all on `queue` makes it visible (ListQueues)."""
        return self.is_superadmin or any(p.pattern.covers(queue) for p in self._state.permissions)

    def admin_patterns(self) -> list[Pattern]:
        return [p.pattern for p in self._state.permissions if p.kind is Kind.ADMIN]

    def valid(self) -> bool:
        """Not revoked and not expired, now."""
        return self._keyring._valid(self._state)

    def key_lost(self) -> asyncio.Future[Unauthenticated]:
        """Resolves (with the reason) when this key is revoked or expires; never for
        the bootstrap key. Shared by every stream of the key: do not cancel it."""
        return self._keyring._lost(self._state)


class Keyring:
    def __init__(self, store: KeyStore, clock: Clock, bootstrap_key: str = "") -> None:
        self._store = store
        self._clock = clock
        self._by_id: dict[str, _KeyState] = {}
        self._by_digest: dict[bytes, _KeyState] = {}
        self.auth_enabled = bool(bootstrap_key)
        if bootstrap_key:
            record = ApiKeyRecord(
                key_id=BOOTSTRAP_NAME,
                name=BOOTSTRAP_NAME,
                digest=apikeys.digest(bootstrap_key),
                created_at_ms=0,
                expires_at_ms=0,
                is_superadmin=True,
            )
            # Not in _by_id: configured, not stored, so it cannot be listed or revoked.
            self._by_digest[record.digest] = _KeyState(record, ())

    def load(self) -> int:
        """Reads every stored key and ACL; returns the number of keys."""
        stored = self._store.load()
        for record in stored.records:
            self._add(_KeyState(record, stored.acls.get(record.key_id, ())))
        return len(stored.records)

    # Authentication, on every call.

    def authenticate(self, presented: str) -> Caller | Refusal:
        wanted = apikeys.digest(presented)
        state = self._by_digest.get(wanted)
        if state is None or not hmac.compare_digest(state.record.digest, wanted):
            return Refusal.UNKNOWN
        if state.record.expired(self._clock.now_ms()):
            return Refusal.EXPIRED
        if state.caller is None:
            state.caller = Caller(self, state)
        return state.caller

    # Key management: superadmins only.

    def create(
        self, caller: Caller | None, name: str, expires_at_ms: int, is_superadmin: bool
    ) -> tuple[ApiKeyRecord, str, Awaitable[None]]:
        """Returns the record, the plaintext key (the only time it exists outside the
        caller) and the future of its write."""
        _require_superadmin(caller, "create API keys")
        apikeys.validate_name(name)
        now = self._clock.now_ms()
        if expires_at_ms and expires_at_ms <= now:
            raise InvalidArgument(
                f"expires_at_ms {expires_at_ms} is not in the future (now is {now})"
            )
        key_id = apikeys.new_key_id()
        while key_id in self._by_id:
            key_id = apikeys.new_key_id()
        plaintext = apikeys.new_key()
        record = ApiKeyRecord(
            key_id=key_id,
            name=name,
            digest=apikeys.digest(plaintext),
            created_at_ms=now,
            expires_at_ms=expires_at_ms,
            is_superadmin=is_superadmin,
        )
        return record, plaintext, self._create(record, caller)

    async def _create(self, record: ApiKeyRecord, caller: Caller | None) -> None:
        await self._store.save_key(record)
        self.mirror_key(record, ())  # (in cluster mode the store's mirror may be first)
        log.info(
            "api key created",
            extra={
                "key_id": record.key_id,
                "key_name": record.name,
                "superadmin": record.is_superadmin,
                "expires_at_ms": record.expires_at_ms,
                "by": _who(caller),
            },
        )

    def revoke(self, caller: Caller | None, key_id: str) -> Awaitable[None]:
        _require_superadmin(caller, "revoke API keys")
        state = self._existing(key_id)
        return self._revoke(state, caller)

    async def _revoke(self, state: _KeyState, caller: Caller | None) -> None:
        key_id = state.record.key_id
        await self._store.delete_key(key_id)
        self.mirror_remove(key_id)
        log.info(
            "api key revoked",
            extra={"key_id": key_id, "key_name": state.record.name, "by": _who(caller)},
        )

    def list_keys(self, caller: Caller | None) -> list[ApiKeyRecord]:
        _require_superadmin(caller, "list API keys")
        return sorted((s.record for s in self._by_id.values()), key=lambda r: r.created_at_ms)

    # ACLs: superadmins, and admins within their own patterns (see the module docstring).

    def set_acl(
        self, caller: Caller | None, key_id: str, pairs: Iterable[tuple[str, str]]
    ) -> Awaitable[None]:
        permissions = parse_permissions(pairs)
        _require_key_id(key_id)
        if caller is not None and not caller.is_superadmin and not caller.admin_patterns():
            raise PermissionDenied(
                f"{caller.describe()} may not set ACLs: it holds no admin permission to delegate"
            )
        if caller is not None and not caller.is_superadmin:
            self._managed(caller, key_id, "set the ACL of")
            domain = caller.admin_patterns()
            for permission in permissions:
                if not may_delegate(domain, permission):
                    raise PermissionDenied(
                        f'{caller.describe()} may not grant "{permission}": it is not inside '
                        f"its admin patterns ({_patterns(domain)})"
                    )
        else:
            self._existing(key_id)
        return self._set_acl(key_id, permissions, caller)

    async def _set_acl(
        self, key_id: str, permissions: tuple[Permission, ...], caller: Caller | None
    ) -> None:
        await self._store.save_acl(key_id, permissions)
        self.mirror_acl(key_id, permissions)
        log.info(
            "acl set",
            extra={
                "key_id": key_id,
                "permissions": ",".join(map(str, permissions)) or "-",
                "by": _who(caller),
            },
        )

    def get_acl(
        self, caller: Caller | None, key_id: str
    ) -> tuple[ApiKeyRecord, tuple[Permission, ...]]:
        _require_key_id(key_id)
        if caller is not None and not caller.is_superadmin and caller.key_id != key_id:
            state = self._managed(caller, key_id, "read the ACL of")
        else:
            state = self._existing(key_id)
        return state.record, state.permissions

    # Changes as stored: this node's own, once written, and (cluster mode:
    # `fila.cluster.shared` mirrors the keys in etcd here) other nodes'. Idempotent: a
    # node also sees its own changes come back.

    def mirror_key(self, record: ApiKeyRecord, permissions: tuple[Permission, ...]) -> None:
        """A key as etcd has it: added with `permissions` if new; a key already here
        keeps its state (a record never changes after its creation)."""
        if record.key_id not in self._by_id:
            self._add(_KeyState(record, permissions))

    def mirror_acl(self, key_id: str, permissions: tuple[Permission, ...]) -> None:
        state = self._by_id.get(key_id)
        if state is not None:
            state.set_permissions(permissions)

    def mirror_remove(self, key_id: str) -> None:
        """A key revoked (here, or through another node): it stops working and its
        open streams end."""
        state = self._by_id.pop(key_id, None)
        if state is None:
            return
        self._by_digest.pop(state.record.digest, None)
        self._end(state, Unauthenticated("API key revoked"))

    # Internals.

    def _add(self, state: _KeyState) -> None:
        self._by_id[state.record.key_id] = state
        self._by_digest[state.record.digest] = state

    def _existing(self, key_id: str) -> _KeyState:
        state = self._by_id.get(key_id)
        if state is None:
            raise ApiKeyNotFound(key_id)
        return state

    def _managed(self, caller: Caller, key_id: str, what: str) -> _KeyState:
        """The key `caller` (an admin, not a superadmin) manages, by id.

        One refusal for every key it does not manage (unknown, revoked, a superadmin, or
        holding grants outside its patterns), naming nothing beyond its own patterns: a
        tenant's admin learns neither other tenants' grants nor which key ids are live."""
        domain = caller.admin_patterns()
        refusal = f'{caller.describe()} may not {what} API key "{key_id}"'
        if not domain:
            raise PermissionDenied(f"{refusal}: it holds no admin permission")
        state = self._by_id.get(key_id)
        if (
            state is None
            or state.record.is_superadmin
            or not all(may_delegate(domain, p) for p in state.permissions)
        ):
            raise PermissionDenied(
                f"{refusal}: not a key within its admin patterns ({_patterns(domain)})"
            )
        return state

    def _valid(self, state: _KeyState) -> bool:
        record = state.record
        live = self._by_digest.get(record.digest) is state  # revocation removes it
        return live and not record.expired(self._clock.now_ms())

    def _lost(self, state: _KeyState) -> asyncio.Future[Unauthenticated]:
        if state.lost is None:
            loop = asyncio.get_running_loop()
            state.lost = loop.create_future()
            if not self._valid(state):  # lost before anything listened: a stream that
                # opened while the key was valid and starts after, say
                state.lost.set_result(Unauthenticated("API key revoked or expired"))
            elif state.record.expires_at_ms:
                delay_s = max(0.0, (state.record.expires_at_ms - self._clock.now_ms()) / 1000)
                state.timer = loop.call_later(
                    delay_s, self._end, state, Unauthenticated("API key expired")
                )
        return state.lost

    @staticmethod
    def _end(state: _KeyState, reason: Unauthenticated) -> None:
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        if state.lost is not None and not state.lost.done():
            state.lost.set_result(reason)


def _require_superadmin(caller: Caller | None, what: str) -> None:
    if caller is not None and not caller.is_superadmin:
        raise PermissionDenied(
            f"{caller.describe()} may not {what}: only superadmin keys manage API keys"
        )


def _require_key_id(key_id: str) -> None:
    if not key_id:
        raise InvalidArgument("key_id must not be empty")


def _who(caller: Caller | None) -> str:
    return "-" if caller is None else caller.key_id


def _patterns(patterns: list[Pattern]) -> str:
    return ", ".join(p.text for p in patterns)
