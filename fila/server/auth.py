"""Authentication at the edge: one interceptor in front of every RPC.

With `[auth] bootstrap_apikey` set, every call except health checks and
reflection must carry `authorization: Bearer <key>` (the scheme is matched
case-insensitively, as HTTP defines it). The interceptor

- refuses a missing, malformed, unknown, revoked or expired key with
  UNAUTHENTICATED before the handler runs, so a refused call changes nothing (in
  cluster mode an unknown key is first looked up in etcd, once: it may have been
  created through another node a moment ago);
  the refusal is logged (peer and key fingerprint, rate-limited) and a peer that
  keeps failing waits longer for its answers (`fila.security.failures`);
- otherwise binds the `Caller` for the handler (`fila.server.access`) and applies
  the method's rule from `access.RULES`, so unary calls on one queue are
  authorized in this one place, before their handler runs. Handlers are
  grpc.aio coroutines or async generators; the wrapper keeps their shape.

A client makes the same calls with the same key over and over, so what does not
change between its calls is built once: the wrapped handler of each (method, key)
is kept (`_HandlerCache`), and the key's ACL answers are remembered per queue
(`fila.security.keyring`, cleared when its ACL changes). What can change is checked
on every call: the presented key is hashed and looked up (so a revoked key is
refused before anything is reused), and the wrapper checks again, when the request
has arrived, that the key is still valid. grpc.aio shows an interceptor the call's
method and metadata but not its connection, so the reuse is per key, which is what
a connection presents on every call.

Without a bootstrap key there is no interceptor: no caller is bound and
`fila.server.access` allows everything.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from fila.clock import SystemClock
from fila.config import AuthSection
from fila.core.errors import BrokerError, Unauthenticated
from fila.security.apikeys import fingerprint
from fila.security.failures import FailureGuard
from fila.security.keyring import Caller, Keyring, Refusal
from fila.security.keystore import LocalKeyStore
from fila.server import access
from fila.server.access import Rule
from fila.server.handlers import Handler, behaviour_of, rebuild
from fila.server.status import abort
from fila.storage.backend import Storage
from fila.storage.committer import Committer

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

log = logging.getLogger("fila.auth")


def load_keyring(storage: Storage, committer: Committer, auth: AuthSection) -> Keyring:
    """The server's keyring with every stored key loaded (called once at startup)."""
    keyring = Keyring(LocalKeyStore(storage, committer), SystemClock(), auth.bootstrap_apikey)
    count = keyring.load()
    log.info("api keys loaded", extra={"count": count, "auth": keyring.auth_enabled})
    return keyring


# Cluster mode: brings a key this node has not seen yet from etcd (see fila.cluster.shared).
KeyLookup: TypeAlias = Callable[[str], Awaitable[None]]


def auth_interceptors(
    keyring: Keyring, lookup: KeyLookup | None = None
) -> list[grpc.aio.ServerInterceptor]:  # type: ignore[type-arg]
    return [AuthInterceptor(keyring, lookup=lookup)] if keyring.auth_enabled else []


def bearer_token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str | Refusal:
    """The key in `authorization: Bearer <key>`; the scheme in any letter case."""
    for key, value in metadata or ():
        if key != "authorization":
            continue
        parts = value.split(None, 1) if isinstance(value, str) else []
        if len(parts) != 2 or parts[0].lower() != "bearer":
            return Refusal.MALFORMED
        return parts[1].strip()
    return Refusal.MISSING


def peer_host(peer: str) -> str:
    """`ipv4:10.0.0.7:51234` -> `ipv4:10.0.0.7`: failures count per host, not per connection."""
    host, sep, _port = peer.rpartition(":")
    return host if sep and host else peer


class _HandlerCache:
    """The authorized wrapper of each (method, caller), built once (see the module
    docstring); at most `limit` of them, forgotten all at once past it."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._wrapped: dict[tuple[str, Caller], tuple[Handler, Handler]] = {}

    def authorized(self, method: str, handler: Handler, caller: Caller) -> Handler:
        key = (method, caller)
        found = self._wrapped.get(key)
        if found is not None and found[0] is handler:
            return found[1]
        if len(self._wrapped) >= self._limit:
            self._wrapped.clear()
        wrapped = _authorized(handler, caller, access.rule_for(method))
        self._wrapped[key] = (handler, wrapped)
        return wrapped


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(
        self, keyring: Keyring, guard: FailureGuard | None = None, lookup: KeyLookup | None = None
    ) -> None:
        self._keyring = keyring
        self._guard = guard or FailureGuard()
        self._lookup = lookup
        self._handlers = _HandlerCache()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        token = bearer_token(handler_call_details.invocation_metadata)
        if isinstance(token, Refusal):
            return self._refusal(handler, method, token, "-")
        caller = self._keyring.authenticate(token)
        if caller is Refusal.UNKNOWN and self._lookup is not None:
            try:
                await self._lookup(token)  # created through another node a moment ago?
            except BrokerError as exc:
                log.warning("could not look the presented key up in etcd: %s", exc)
            caller = self._keyring.authenticate(token)
        if isinstance(caller, Refusal):
            return self._refusal(handler, method, caller, fingerprint(token))
        return self._handlers.authorized(method, handler, caller)

    def _refusal(self, handler: Handler, method: str, refusal: Refusal, key_print: str) -> Handler:
        guard = self._guard

        async def deny(request: Any, context: Context) -> None:
            peer = context.peer()
            verdict = guard.failed(peer_host(peer))
            if verdict.log:
                log.warning(
                    "auth failed",
                    extra={
                        "peer": peer,
                        "reason": refusal.name.lower(),
                        "key_fingerprint": key_print,
                        "method": method,
                        "delay_ms": int(verdict.delay_s * 1000),
                        "unlogged_before": verdict.unlogged_before,
                    },
                )
            if verdict.delay_s:
                try:
                    await asyncio.sleep(verdict.delay_s)
                finally:
                    guard.released()
            await abort(context, Unauthenticated(refusal.value))

        return rebuild(handler, deny)


def _authorized(handler: Handler, caller: Caller, rule: Rule) -> Handler:
    """`handler` with `caller` bound and `rule` checked before its behaviour runs."""

    # A streamed request's items name their own queues (Scope.EACH_ITEM): nothing to read.
    reads_request = not handler.request_streaming

    async def admit(request: Any, context: Context) -> None:
        # Checked again here, when the request has arrived: a call opened while the key
        # was valid may send its request after a revocation or the expiry.
        if not caller.valid():
            await abort(context, Unauthenticated("API key revoked or expired"))
        access.bind(caller)
        refusal = rule.check(caller, request if reads_request else None)
        if refusal is not None:
            await abort(context, refusal)

    behaviour = behaviour_of(handler)
    if inspect.isasyncgenfunction(behaviour):

        async def generate(request: Any, context: Context) -> AsyncIterator[Any]:
            await admit(request, context)
            async for response in behaviour(request, context):
                yield response

        return rebuild(handler, generate)

    async def run(request: Any, context: Context) -> Any:
        await admit(request, context)
        return await behaviour(request, context)

    return rebuild(handler, run)
