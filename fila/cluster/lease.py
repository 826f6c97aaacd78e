"""This node's etcd lease: its membership, and the fencing rule that keeps one queue
from ever being served by two nodes (SPEC 9).

The node holds a lease of `lease_ttl_ms` (rounded up to whole seconds, as etcd
grants them) and attaches its membership key to it (`fila.cluster.nodes`). It
renews the lease every third of the TTL. The fencing rule is local and needs no
answer from etcd, because a node cut off from etcd cannot ask:

    a node serves its queues only until  t_sent + TTL,

where t_sent is when it *sent* the last renewal etcd acknowledged (and the TTL is
the smaller of etcd's and `lease_ttl_ms`). etcd restarts a lease's countdown when it
*receives* a renewal, which is later, so this node's deadline always comes first:
once etcd may have expired the lease, this node has already stopped. A node cut off
at time T stops by T + TTL at the latest (its last renewal was sent before T). The
deadline is checked on every call (`serving`), so no call is served past it even if
the event loop is busy, and a timer at the deadline ends the node's consume streams.

When renewals get through again the node serves again: with the same lease if etcd
still has it, else with a new lease and a new membership key (`_join`). A node id is
claimed with a create-if-absent transaction, so two live processes can never both
hold one id; a key held by the lease this data directory recorded last belongs to
this node's own dead predecessor and is revoked at once (see `fila.cluster.identity`).

A node id held by another lease at startup is waited out: a dead predecessor's lease
(one this data directory did not record: a node replaced with a new disk, say) expires
within its TTL, so after two TTLs (plus a second) a holder is a live node with this id,
and the node refuses to start (`NodeIdTaken`), naming that node's address.

Nor may two live nodes advertise one address: the others forward a node's calls to
the address in its record, so the second would receive the first's calls (and the
first the second's). Addresses are compared by the socket address they name, not as
text (`fila.cluster.address`). A node whose `advertise_addr` another live node id
holds does not join; it waits as for a held node id (a predecessor at that address
under another id is gone once its lease expires), then refuses to start
(`AddressTaken`). Its own id's record does not count, so a node restarting, or
replaced under its id, joins as ever.

Both refusals are `Misconfigured`: `fila-server` exits with code 2, a configuration
error, which systemd does not restart into the same refusal (deploy/fila.service).
Either way the node says why as soon as it starts waiting, not only when it gives up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Final

from fila.cluster.address import Addresses
from fila.cluster.errors import Fenced, Misconfigured
from fila.cluster.etcd import Etcd, EtcdUnavailable
from fila.cluster.identity import Identity
from fila.cluster.layout import NODES, Layout, NodeRecord
from fila.core.errors import BrokerError

log = logging.getLogger("fila.cluster")

RETRY_S: Final = 0.2  # between attempts while etcd does not answer
HELD_RETRY_S: Final = 0.5  # while another live process holds this node id


class NodeIdTaken(Misconfigured):
    """Another live node holds this node id in etcd."""


class AddressTaken(Misconfigured):
    """Another live node (another id) advertises this node's `advertise_addr`: a
    configuration error (see the module docstring)."""


class NodeLease:
    def __init__(
        self,
        etcd: Etcd,
        layout: Layout,
        record: NodeRecord,
        ttl_ms: int,
        identity: Identity,
        on_fenced: Callable[[BrokerError], None],
        addresses: Addresses | None = None,
    ) -> None:
        self._etcd = etcd
        self._key = layout.node(record.node_id)
        self._nodes = layout.section(NODES)
        self._record = record
        self._ttl_s = max(1, math.ceil(ttl_ms / 1000))
        self._ttl_ms = ttl_ms
        self._identity = identity
        self._on_fenced = on_fenced
        self._addresses = addresses or Addresses()
        self._lease = 0
        self._previous = identity.last_lease()
        self._valid_until = 0.0
        self._fenced = True
        self._timer: asyncio.TimerHandle | None = None
        self._repair = asyncio.Event()
        self._holder = 0  # the lease holding our id when a join found it taken
        self._holder_record: NodeRecord | None = None  # and the record it holds
        self._served = False
        self._leaving = False
        self._listeners: list[Callable[[], None]] = []

    @property
    def node_id(self) -> int:
        return self._record.node_id

    @property
    def lease(self) -> int:
        """The lease this node's membership key is on now (0: none)."""
        return self._lease

    def subscribe(self, listener: Callable[[], None]) -> None:
        """`listener()` whenever the lease changes (joined with a new one, or lost)."""
        self._listeners.append(listener)

    def _set_lease(self, lease: int) -> None:
        if lease != self._lease:
            self._lease = lease
            for listener in self._listeners:
                listener()

    @property
    def serving(self) -> bool:
        """Whether this node may serve its queues now (see the module docstring)."""
        return asyncio.get_running_loop().time() < self._valid_until

    def fenced_error(self) -> Fenced:
        if self._leaving:
            return Fenced(f"node {self.node_id} is shutting down: its queues are unavailable")
        return Fenced(
            f"node {self.node_id} has lost its etcd lease: its queues are unavailable until "
            "it renews it (is etcd reachable from this node?)"
        )

    # -- joining ---------------------------------------------------------------------

    async def acquire(self, patience_s: float) -> None:
        """Joins the cluster at startup. Raises EtcdUnavailable once etcd did not answer
        for `patience_s`, and NodeIdTaken (AddressTaken) once another holder of this
        node id (another node at this node's address) outlived two lease TTLs (a dead
        one's lease would have expired by then)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience_s
        held_until: float | None = None
        while True:
            try:
                other = await self._same_address()
                if other is None and await self._join():
                    return
                message = (
                    self._address_message(other) if other is not None else self._held_message()
                )
                if held_until is None:
                    held_until = loop.time() + 2 * self._ttl_s + 1
                    # Why startup waits: said once, at once (the refusal comes 2 TTLs later).
                    log.warning("not joining yet: %s", message)
                if loop.time() >= held_until:
                    raise AddressTaken(message) if other is not None else NodeIdTaken(message)
            except EtcdUnavailable:
                if loop.time() >= deadline:
                    raise
            await asyncio.sleep(HELD_RETRY_S)

    async def _join(self) -> bool:
        """A new lease and the membership key on it; False if a live node holds the id."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        lease, granted = await self._etcd.grant(self._ttl_s)
        try:
            await self._identity.record_lease(lease)
            for _attempt in range(2):
                record = replace(self._record, lease=lease)
                created = await self._etcd.create(self._key, record.encode(), lease=lease)
                holder = created.entry
                # The key on the lease just granted (only this process knows it) is ours:
                # a create whose connection closed under it (a hung etcd member's, see
                # fila.cluster.etcd) is made again by etcd3aio, and finds its own key.
                if created.created or (holder is not None and holder.lease == lease):
                    self._previous = lease
                    self._renewed(sent, granted)
                    self._set_lease(lease)
                    log.info(
                        "joined the cluster node=%d lease=%x ttl_s=%d", self.node_id, lease, granted
                    )
                    return True
                self._holder = holder.lease if holder is not None else 0
                self._holder_record = _decoded(holder.value) if holder is not None else None
                if not (self._previous and self._holder == self._previous):
                    break
                # Our own dead predecessor's lease: end it now instead of waiting it out.
                log.info("revoking this node's previous lease %x", self._holder)
                await self._etcd.revoke(self._holder)
        except BaseException:
            await self._revoke_quietly(lease)
            raise
        await self._revoke_quietly(lease)
        return False

    async def _same_address(self) -> NodeRecord | None:
        """A live node with another id whose record advertises this node's address
        (however it is written: `fila.cluster.address`)."""
        snapshot = await self._etcd.get_prefix(self._nodes)
        others = [
            record
            for record in map(_decoded, (entry.value for entry in snapshot.entries))
            if record is not None and record.node_id != self.node_id
        ]
        own = self._record.advertise_addr
        same = await asyncio.gather(
            *(self._addresses.same(own, record.advertise_addr) for record in others)
        )
        return next((record for record, hit in zip(others, same, strict=True) if hit), None)

    def _address_message(self, other: NodeRecord) -> str:
        own = self._record.advertise_addr
        written = "" if other.advertise_addr == own else f" (as {other.advertise_addr})"
        return (
            f"advertise_addr {own} is advertised by live node {other.node_id}{written}: "
            "every node needs an address of its own (the others forward its calls "
            f"there). Give node {self.node_id} its own advertise_addr (or "
            "FILA_ADVERTISE_ADDR)"
        )

    def _held_message(self) -> str:
        other = self._holder_record
        where = f"at {other.advertise_addr}, " if other is not None else ""
        return (
            f"node id {self.node_id} is held in etcd by another live node ({where}lease "
            f"{self._holder:x}): node ids must be unique (a dead node's lease expires "
            f"within {self._ttl_s}s). Give this node an id of its own (node_id or "
            "FILA_NODE_ID)"
        )

    async def _revoke_quietly(self, lease: int) -> None:
        with contextlib.suppress(EtcdUnavailable):  # else it expires on its own
            await self._etcd.revoke(lease)

    # -- staying alive ---------------------------------------------------------------

    async def run(self) -> None:
        """Renews the lease forever; rejoins when it is lost (see the module docstring)."""
        loop = asyncio.get_running_loop()
        interval = self._ttl_s / 3
        failures = 0
        while True:
            if not self._lease:
                try:
                    joined = await self._join()
                except EtcdUnavailable:
                    joined = False
                if not joined:
                    await asyncio.sleep(HELD_RETRY_S)
                continue
            if self._repair.is_set():
                await self._restore_key()
            sent = loop.time()
            try:
                ttl = await self._etcd.keepalive(self._lease, timeout_s=interval)
            except EtcdUnavailable as exc:
                failures += 1
                if failures == 1 or failures % 50 == 0:
                    log.warning("lease renewal failed (%d in a row): %s", failures, exc)
                await asyncio.sleep(RETRY_S)
                continue
            failures = 0
            if ttl <= 0:
                log.error("etcd expired this node's lease %x; rejoining", self._lease)
                self._set_lease(0)
                self._fence()
                continue
            self._renewed(sent, ttl)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._repair.wait(), interval)

    def key_deleted(self) -> None:
        """Our membership key vanished while the lease may live (deleted by hand):
        put it back at the next renewal."""
        self._repair.set()

    async def _restore_key(self) -> None:
        self._repair.clear()
        try:
            record = replace(self._record, lease=self._lease)
            created = await self._etcd.create(self._key, record.encode(), lease=self._lease)
        except EtcdUnavailable:
            self._repair.set()
            return
        holder = created.entry
        if not created.created and (holder is None or holder.lease != self._lease):
            log.error("membership key taken by lease %x; rejoining", holder.lease if holder else 0)
            self._set_lease(0)
            self._fence()

    def _renewed(self, sent: float, ttl_s: int) -> None:
        loop = asyncio.get_running_loop()
        self._valid_until = sent + min(ttl_s, self._ttl_ms / 1000)
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(self._valid_until, self._deadline)
        if self._fenced:
            self._fenced = False
            if self._served:
                log.warning("serving again node=%d (lease %x)", self.node_id, self._lease)
            self._served = True

    def _deadline(self) -> None:
        self._timer = None
        if not self.serving:
            log.error(
                "lease not renewed within %d ms: node %d stops serving its queues",
                self._ttl_ms,
                self.node_id,
            )
            self._fence()

    def _fence(self) -> None:
        self._valid_until = 0.0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._fenced:
            self._fenced = True
            self._on_fenced(self.fenced_error())

    # -- leaving ---------------------------------------------------------------------

    async def release(self) -> None:
        """Leaves the cluster (graceful shutdown): revoking the lease deletes the
        membership key, so the other nodes see this node down at once."""
        self._leaving = True
        self._fence()
        if self._lease:
            lease = self._lease
            self._set_lease(0)
            await self._revoke_quietly(lease)


def _decoded(raw: bytes) -> NodeRecord | None:
    """A membership key's record; None if unreadable (fila.cluster.nodes logs those)."""
    try:
        return NodeRecord.decode(raw)
    except (ValueError, KeyError, TypeError):  # json's errors are ValueErrors
        return None
