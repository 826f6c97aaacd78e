"""The cluster's only door to etcd: the few v3 calls cluster mode makes, typed, over
`etcd3aio` (see the pyproject.toml comment for why that client).

Nothing else imports `etcd3aio`, so its API, its retries and its errors stop here:
callers see `Entry`, `Snapshot`, `Change` and one error, `EtcdUnavailable` (an
UNAVAILABLE `BrokerError`), raised when etcd cannot be reached or does not answer in
time. Every unary call has a deadline, because a node cut off from etcd must notice
(it stops serving, see `fila.cluster.lease`) rather than wait on a call forever.

Keys and prefixes are `str` (the cluster's layout is text, see `fila.cluster.layout`);
values are bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar, cast

import grpc
import grpc.aio
from etcd3aio import Etcd3Client, EtcdError, prefix_range_end
from etcd3aio._protobuf import Compare
from etcd3aio.kv import KVService

from fila.cluster.reconnect import RECONNECT_BACKOFF
from fila.core.errors import Unavailable

log = logging.getLogger("fila.cluster")

T = TypeVar("T")

# Unary calls (reads, writes, lease grants) give up after this; keepalives pass their own.
CALL_TIMEOUT_S: Final = 3.0
# A read not answered within this is made a second time, in parallel (see `_hedged`).
READ_HEDGE_S: Final = 1.0
# A watch that lost its stream reconnects after at most this (etcd3aio backs off to it).
WATCH_MAX_BACKOFF_S: Final = 0.5
_DELETE: Final = 1  # mvccpb.Event.EventType.DELETE

# How the etcd channel notices a member that accepts connections but answers nothing
# (hung, SIGSTOPped, its host overloaded). The channel round-robins calls over the
# members and the TCP connection to a hung member stays up, so a third of the calls
# (three members) went to it and timed out, until a ping it left unanswered closed the
# connection after `grpc.http2.ping_timeout_ms`: 60 s by default. (This grpcio, 1.85,
# applies that to keepalive pings too and ignores `grpc.keepalive_timeout_ms`: measured;
# both are set.) Made again, the connection gets no HTTP/2 SETTINGS back, so
# round_robin leaves the member out until it answers.
#
# etcd's server bounds the pings: one closer than `--grpc-keepalive-min-time` (5 s by
# default) to the last, or any on a connection without an open call (etcd does not
# permit pings without streams), is a strike, and the third strike in a row (nothing
# sent by etcd in between) gets a GOAWAY "too_many_pings", which ends every watch on
# that connection too. So: a keepalive ping once a connection has read nothing for 6 s,
# with or without an open call (a hung member is found before a call waits on it), at
# most two in a row before this side sends something again (never a third strike on an
# idle connection; every call starts the count again), and the connection closed once
# any ping (gRPC's flow-control pings after answers too) goes unanswered for 2 s. A hung
# member is out of rotation 2 to 8 s after it last answered.
KEEPALIVE_OPTIONS: Final = (
    ("grpc.keepalive_time_ms", 6_000),
    ("grpc.keepalive_timeout_ms", 2_000),
    ("grpc.http2.ping_timeout_ms", 2_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 2),
)


class EtcdUnavailable(Unavailable):
    """etcd did not answer (unreachable, no quorum, or too slow)."""


def _is_ipv4(host: str) -> bool:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


async def grpc_target(endpoints: Sequence[str]) -> str:
    """The gRPC target for `endpoints` (host:port each). etcd3aio always builds an
    `ipv4:` target, which takes IPv4 literals only: a host name failed every call
    ("target uri is not valid") until the node gave up. So: IPv4 literals (and
    localhost) stay a round-robin `ipv4:` list; one host name becomes a `dns:` target,
    which gRPC resolves again when it reconnects (an etcd member that moved); several
    endpoints with names among them are resolved here, once, to their IPv4 addresses."""
    split = (endpoint.rpartition(":") for endpoint in endpoints)
    pairs = [("127.0.0.1" if host == "localhost" else host, port) for host, _, port in split]
    if all(_is_ipv4(host) for host, _ in pairs):
        return "ipv4:" + ",".join(f"{host}:{port}" for host, port in pairs)
    if len(endpoints) == 1:
        return f"dns:///{endpoints[0]}"
    loop = asyncio.get_running_loop()
    addresses: list[str] = []
    for host, port in pairs:
        try:
            found = await loop.getaddrinfo(host, int(port), family=socket.AF_INET)
        except OSError as exc:
            raise EtcdUnavailable(f"etcd endpoint {host}:{port} does not resolve: {exc}") from None
        addresses += [f"{info[4][0]}:{port}" for info in found]
    return "ipv4:" + ",".join(dict.fromkeys(addresses))


class WatchLost(Exception):
    """etcd cancelled the watch (a compacted revision, or the server ended it): the
    caller must read a fresh snapshot before watching again."""


@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every entry under a prefix, read at one `revision`."""

    entries: list[Entry]
    revision: int


@dataclass(frozen=True, slots=True)
class Change:
    """One watch event; `value` None means the key was deleted (at `revision`)."""

    key: str
    value: bytes | None
    revision: int


@dataclass(frozen=True, slots=True)
class Swapped:
    """The answer of `swap`: whether it put the value, the entry there now (None:
    absent), and the revision of that state."""

    swapped: bool
    entry: Entry | None
    revision: int


@dataclass(frozen=True, slots=True)
class Created:
    """The answer of `create`: whether this call created the key, the entry that is
    there now, and the revision of that state."""

    created: bool
    entry: Entry | None
    revision: int


class Etcd:
    def __init__(self, endpoints: Sequence[str]) -> None:
        self._endpoints = list(endpoints)
        self._client = Etcd3Client(
            self._endpoints,
            # Retries within one call's deadline; beyond that the caller decides.
            rpc_max_attempts=3,
            watch_reconnect_backoff_seconds=0.1,
            watch_max_reconnect_backoff_seconds=WATCH_MAX_BACKOFF_S,
        )
        # etcd3aio takes no channel options; its ConnectionManager builds the channel
        # from this list in connect(). Without RECONNECT_BACKOFF the channel waits up to
        # 120 s between attempts after a long etcd outage, and the node with it; see
        # KEEPALIVE_OPTIONS for the rest. Ours replace etcd3aio's own keepalive options
        # rather than follow them, so no option appears twice.
        options = self._client._manager.grpc_options
        ours = (*RECONNECT_BACKOFF, *KEEPALIVE_OPTIONS)
        names = {name for name, _ in ours}
        options[:] = [option for option in options if option[0] not in names]
        options.extend(ours)

    @property
    def endpoints(self) -> list[str]:
        return self._endpoints

    async def open(self) -> None:
        """Connects (see `grpc_target` for how the endpoints are read); raises
        `EtcdUnavailable` when a host name among several does not resolve."""
        self._client._manager.target = await grpc_target(self._endpoints)
        await self._client.connect()

    async def close(self) -> None:
        await self._client.close()

    # -- reads -----------------------------------------------------------------------

    async def get(self, key: str) -> tuple[Entry | None, int]:
        """The entry at `key` (None if absent) and the revision it was read at."""
        response = await self._hedged(
            lambda timeout: self._call("get", self._kv.get(key, timeout=timeout)),
            CALL_TIMEOUT_S,
            READ_HEDGE_S,
        )
        kvs = list(response.kvs)
        return (_entry(kvs[0]) if kvs else None), int(response.header.revision)

    async def get_prefix(self, prefix: str) -> Snapshot:
        end = prefix_range_end(prefix)
        response = await self._hedged(
            lambda timeout: self._call("get", self._kv.get(prefix, end, timeout=timeout)),
            CALL_TIMEOUT_S,
            READ_HEDGE_S,
        )
        return Snapshot([_entry(kv) for kv in response.kvs], int(response.header.revision))

    # -- writes (each answers the revision it produced) --------------------------------

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        response = await self._call(
            "put", self._kv.put(key, value, lease=lease, timeout=CALL_TIMEOUT_S)
        )
        return int(response.header.revision)

    async def put_many(self, items: dict[str, bytes]) -> int:
        """Puts every item in one transaction."""
        ops = [KVService.txn_op_put(key, value) for key, value in items.items()]
        response = await self._call("put", self._kv.txn([], ops, timeout=CALL_TIMEOUT_S))
        return int(response.header.revision)

    async def delete(self, *keys: str) -> int:
        """Deletes `keys` in one transaction."""
        ops = [KVService.txn_op_delete(key) for key in keys]
        response = await self._call("delete", self._kv.txn([], ops, timeout=CALL_TIMEOUT_S))
        return int(response.header.revision)

    async def create(self, key: str, value: bytes, *, lease: int = 0) -> Created:
        """Puts `key` only if it does not exist (a transaction on its create revision),
        so of two concurrent creates exactly one wins."""
        response = await self._call(
            "create",
            self._kv.txn(
                [KVService.txn_compare_create_revision(key, 0)],
                [KVService.txn_op_put(key, value, lease=lease)],
                [KVService.txn_op_get(key)],
                timeout=CALL_TIMEOUT_S,
            ),
        )
        revision = int(response.header.revision)
        if response.succeeded:
            return Created(True, Entry(key, value, revision, lease), revision)
        kvs = list(response.responses[0].response_range.kvs) if response.responses else []
        return Created(False, _entry(kvs[0]) if kvs else None, revision)

    async def swap(
        self,
        key: str,
        expected: bytes | None,
        value: bytes,
        *,
        not_on_lease: tuple[str, int] | None = None,
        on_leases: Sequence[tuple[str, int]] = (),
    ) -> Swapped:
        """Puts `value` at `key` only if `key` holds exactly `expected` (None: `key`
        does not exist), with `not_on_lease` = (other key, lease), the other key is
        not attached to that lease (absent, or on another), and each (key, lease) of
        `on_leases` is attached to exactly that lease: one transaction, so of two
        rivals deciding on the same value exactly one wins. Not made again when etcd
        does not answer (the first may have been applied: the caller reads to know)."""
        compare = [
            KVService.txn_compare_create_revision(key, 0)
            if expected is None
            else KVService.txn_compare_value(key, expected)
        ]
        if not_on_lease is not None:
            other, lease = not_on_lease
            compare.append(
                Compare(
                    result=Compare.NOT_EQUAL,
                    target=Compare.LEASE,
                    key=other.encode(),
                    lease=lease,
                )
            )
        for other, lease in on_leases:
            compare.append(
                Compare(result=Compare.EQUAL, target=Compare.LEASE, key=other.encode(), lease=lease)
            )
        response = await self._call(
            "transaction",
            self._kv.txn(
                compare,
                [KVService.txn_op_put(key, value)],
                [KVService.txn_op_get(key)],
                timeout=CALL_TIMEOUT_S,
                max_attempts=1,
            ),
        )
        revision = int(response.header.revision)
        if response.succeeded:
            return Swapped(True, Entry(key, value, revision, 0), revision)
        kvs = list(response.responses[0].response_range.kvs) if response.responses else []
        return Swapped(False, _entry(kvs[0]) if kvs else None, revision)

    # -- leases ----------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: its id and the TTL etcd granted (etcd may raise a short one)."""
        response = await self._call("lease grant", self._lease.grant(ttl_s, timeout=CALL_TIMEOUT_S))
        return int(response.ID), int(response.TTL)

    async def keepalive(self, lease: int, timeout_s: float) -> int:
        """Renews `lease` once; its TTL from now, or 0 when etcd no longer has it.
        Hedged after half of `timeout_s` (a renewal is idempotent): a node whose
        renewals went to a hung member twice running would stop serving."""

        async def renew(within_s: float) -> int:
            call = self._lease.keep_alive(lease)
            try:
                response = await self._call("lease keepalive", _first(call), timeout_s=within_s)
            finally:
                call.cancel()
            return int(response.TTL) if response is not None else 0

        return await self._hedged(renew, timeout_s, timeout_s / 2)

    async def revoke(self, lease: int) -> None:
        """Revokes `lease` (deleting its keys); a lease etcd no longer has is fine."""
        try:
            await self._call(
                "lease revoke",
                self._lease.revoke(lease, timeout=CALL_TIMEOUT_S),
                pass_not_found=True,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise EtcdUnavailable(f"etcd lease revoke failed: {exc.details()}") from None

    # -- watch -----------------------------------------------------------------------

    async def watch(self, prefix: str, start_revision: int) -> AsyncIterator[list[Change]]:
        """The changes under `prefix` from `start_revision` on, a batch per etcd response,
        in revision order. Transient disconnections are retried from the next revision
        (inside etcd3aio); `WatchLost` ends it when etcd cancels the watch."""
        assert self._client.watch is not None, "open() first"
        stream = self._client.watch.watch(prefix, prefix_range_end(prefix), start_revision)
        responses = cast(AsyncGenerator[Any, None], stream)
        async with contextlib.aclosing(responses):
            try:
                async for response in responses:
                    if response.canceled or response.compact_revision:
                        raise WatchLost(
                            f"etcd cancelled the watch of {prefix} (compacted to revision "
                            f"{response.compact_revision}: {response.cancel_reason or '-'})"
                        )
                    changes = [
                        Change(
                            event.kv.key.decode(),
                            None if event.type == _DELETE else bytes(event.kv.value),
                            int(event.kv.mod_revision),
                        )
                        for event in response.events
                    ]
                    if changes:
                        yield changes
            except (EtcdError, grpc.aio.AioRpcError) as exc:
                raise EtcdUnavailable(f"etcd watch failed: {exc}") from None

    # -- plumbing --------------------------------------------------------------------

    @property
    def _kv(self) -> KVService:
        assert self._client.kv is not None, "open() first"
        return self._client.kv

    @property
    def _lease(self) -> Any:
        assert self._client.lease is not None, "open() first"
        return self._client.lease

    async def _hedged(
        self, attempt: Callable[[float], Awaitable[T]], timeout_s: float, hedge_s: float
    ) -> T:
        """An idempotent call (`attempt(timeout)` makes one), hedged: one unanswered
        after `hedge_s` is made again, in parallel, and the first answer wins; both
        end within `timeout_s`. Until the channel has taken a hung member out (see
        KEEPALIVE_OPTIONS) a third of the calls go to it and wait out their deadline;
        the second attempt most likely goes to another member (round robin), while a
        call that is only slow (a large prefix) still gets its whole `timeout_s`. Reads
        and lease renewals only: a write that did not answer may have been applied, and
        a second one is not the same call (a create would find its own key)."""
        attempts = [asyncio.ensure_future(attempt(timeout_s))]
        try:
            done, _ = await asyncio.wait(attempts, timeout=hedge_s)
            if done:
                return attempts[0].result()
            attempts.append(asyncio.ensure_future(attempt(timeout_s - hedge_s)))
            failure: EtcdUnavailable | None = None
            for answer in asyncio.as_completed(attempts):
                try:
                    return await answer
                except EtcdUnavailable as exc:
                    failure = exc
            assert failure is not None
            raise failure
        finally:  # the attempt not used, or both when the caller was cancelled
            for task in attempts:
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    task.exception()  # retrieved, so never logged as unhandled

    async def _call(
        self, what: str, call: Any, *, timeout_s: float | None = None, pass_not_found: bool = False
    ) -> Any:
        """Awaits one etcd call, turning every way it can fail into EtcdUnavailable
        (non-transient gRPC errors included: to a broker they all mean "etcd cannot do
        this now"). NOT_FOUND too unless `pass_not_found`: a write on a lease that
        expired meanwhile gets it ("requested lease not found", e.g. a node's join whose
        create outlived its new lease's TTL), and its caller retries as for any other
        failure rather than end on an unexpected error."""
        try:
            if timeout_s is None:
                return await call
            return await asyncio.wait_for(call, timeout_s)
        except TimeoutError:
            raise EtcdUnavailable(
                f"etcd ({', '.join(self._endpoints)}) did not answer a {what} in time"
            ) from None
        except EtcdError as exc:
            raise EtcdUnavailable(f"etcd ({', '.join(self._endpoints)}): {what}: {exc}") from None
        except grpc.aio.AioRpcError as exc:
            if pass_not_found and exc.code() == grpc.StatusCode.NOT_FOUND:
                raise
            raise EtcdUnavailable(
                f"etcd ({', '.join(self._endpoints)}): {what}: {exc.code().name} {exc.details()}"
            ) from None


async def _first(call: Any) -> Any:
    async for response in call:
        return response
    return None


def _entry(kv: Any) -> Entry:
    return Entry(kv.key.decode(), bytes(kv.value), int(kv.mod_revision), int(kv.lease))
