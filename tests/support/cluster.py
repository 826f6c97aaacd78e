"""Cluster-mode test harness: etcd, `fila-server` nodes wired to it, and network
namespaces to cut a node off from etcd.

Everything started here is stopped by its owner's `close()` (the fixtures call it
even when a test fails): nodes, etcd members, namespaces and their veth pairs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from fila.cluster.etcd import Etcd
from fila.cluster.layout import Layout
from fila.testing.children import free_port
from fila.testing.etcd import EtcdCluster, etcd_binary
from fila.testing.server import ServerProcess
from fila.v1 import admin_pb2, admin_pb2_grpc, service_pb2_grpc
from support.stubs import Fila

# Tests use a short lease so that expiry and fencing are seen in seconds.
LEASE_TTL_MS = 2000
# For tests that wait for no expiry: a node starved for a second on a loaded CI machine
# keeps its queues.
LONG_LEASE_MS = 15_000


def require_etcd() -> None:
    """Skips the caller when etcd is not installed, except under CI=true, where a
    missing etcd is a failure (CI installs etcd-server, see .ci/run)."""
    if etcd_binary() is not None:
        return
    message = "etcd is not installed (apt-get install etcd-server): cluster tests need it"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def node_config(
    node_id: int,
    advertise_addr: str,
    endpoints: Sequence[str],
    *,
    extra: str = "",
    lease_ttl_ms: int = LEASE_TTL_MS,
) -> str:
    quoted = ", ".join(f'"{e}"' for e in endpoints)
    return (
        f'[cluster]\nnode_id = {node_id}\nadvertise_addr = "{advertise_addr}"\n'
        f"etcd_endpoints = [{quoted}]\nlease_ttl_ms = {lease_ttl_ms}\n{extra}"
    )


_FIELDS = ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")


class _Details(
    collections.namedtuple("_Details", _FIELDS),
    grpc.ClientCallDetails,  # type: ignore[misc]
):
    pass


class Bearer(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds `authorization: Bearer <key>` to every call of a channel."""

    def __init__(self, api_key: str) -> None:
        self._metadata = (("authorization", f"Bearer {api_key}"),)

    def _details(self, details: Any) -> _Details:
        return _Details(
            details.method,
            details.timeout,
            [*(details.metadata or ()), *self._metadata],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class Cluster:
    """An etcd and fila-server nodes 1..N on it; `node(i)` is node i's process.
    Channels carry `api_key` (when given) on every call."""

    def __init__(
        self,
        root: Path,
        etcd: EtcdCluster,
        *,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        lease_ttl_ms: int = LEASE_TTL_MS,
    ):
        self.root = root
        self.etcd = etcd
        self.lease_ttl_ms = lease_ttl_ms
        self.env = env or {}
        self.api_key = api_key
        self.nodes: dict[int, ServerProcess] = {}
        self._channels: list[grpc.Channel] = []

    def add(
        self,
        node_id: int,
        *,
        start: bool = True,
        host: str = "127.0.0.1",
        wrapper: list[str] | None = None,
        endpoints: Sequence[str] | None = None,
        extra: str = "",
    ) -> ServerProcess:
        port = free_port()
        config = node_config(
            node_id,
            f"{host}:{port}",
            endpoints or self.etcd.endpoints,
            extra=extra,
            lease_ttl_ms=self.lease_ttl_ms,
        )
        proc = ServerProcess(
            self.root / f"node{node_id}" / "data",
            config_toml=config,
            env=self.env,
            host=host,
            port=port,
            wrapper=wrapper,
        )
        self.nodes[node_id] = proc
        return proc.start() if start else proc

    def node(self, node_id: int) -> ServerProcess:
        return self.nodes[node_id]

    def channel(self, node_id: int, api_key: str | None = None) -> grpc.Channel:
        raw = grpc.insecure_channel(self.nodes[node_id].addr)
        self._channels.append(raw)
        key = api_key or self.api_key
        return grpc.intercept_channel(raw, Bearer(key)) if key else raw

    def fila(self, node_id: int, api_key: str | None = None) -> Fila:
        """`support.stubs.Fila` (raw stubs and helpers) through node `node_id`."""
        channel = self.channel(node_id, api_key)
        return Fila(
            channel,
            service_pb2_grpc.FilaServiceStub(channel),
            admin_pb2_grpc.FilaAdminStub(channel),
        )

    def service(self, node_id: int) -> service_pb2_grpc.FilaServiceStub:
        return service_pb2_grpc.FilaServiceStub(self.channel(node_id))

    def admin(self, node_id: int) -> admin_pb2_grpc.FilaAdminStub:
        return admin_pb2_grpc.FilaAdminStub(self.channel(node_id))

    def leaders(self, via: int) -> dict[str, int]:
        reply = self.admin(via).ListQueues(admin_pb2.ListQueuesRequest(), timeout=10)
        return {q.name: q.leader_node_id for q in reply.queues}

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        errors: list[BaseException] = []
        for proc in self.nodes.values():
            try:
                if proc.running:
                    proc.stop()
            except (TimeoutError, OSError) as exc:
                errors.append(exc)
        self.etcd.stop()
        if errors:
            raise errors[0]


@contextlib.contextmanager
def cluster(
    root: Path,
    nodes: int = 3,
    *,
    bootstrap_key: str | None = None,
    lease_ttl_ms: int = LEASE_TTL_MS,
) -> Iterator[Cluster]:
    """One etcd member and `nodes` fila-server nodes, all stopped on exit."""
    require_etcd()
    etcd = EtcdCluster(root / "etcd").start()
    env = {"FILA_BOOTSTRAP_APIKEY": bootstrap_key} if bootstrap_key else None
    made = Cluster(root, etcd, env=env, api_key=bootstrap_key, lease_ttl_ms=lease_ttl_ms)
    try:
        for node_id in range(1, nodes + 1):
            made.add(node_id)
        yield made
    finally:
        made.close()


@contextlib.contextmanager
def paused(proc: ServerProcess) -> Iterator[None]:
    """SIGSTOPs `proc` and continues it on exit: alive, its connections open, but
    answering nothing, as a hung node (or one behind a silent network) looks to the
    others; etcd counts it down once its lease TTL passes."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def lease_kept(made: Cluster, node_id: int) -> Iterator[None]:
    """Keeps node `node_id`'s etcd lease alive from the test until exit, or until etcd
    no longer has it (the restarted node revoked it). Why: a test that kills a node
    and starts it again to see it revoke its dead predecessor's lease raced the lease
    TTL; on a loaded CI machine the restart took longer than 2 s, found the lease
    expired, and the revoke went unseen."""
    held = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    failures: list[BaseException] = []

    async def keep() -> None:
        client = Etcd(made.etcd.endpoints)
        await client.open()
        try:
            entry, _revision = await client.get(Layout("/fila").node(node_id))
            if entry is None or not entry.lease:
                raise AssertionError(f"node {node_id} has no record on a lease in etcd")
            held.set()
            while await client.keepalive(entry.lease, 1.0):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.1)
                    return
        finally:
            await client.close()

    def run() -> None:
        try:
            loop.run_until_complete(keep())
        except BaseException as exc:  # handed to the test's thread below
            failures.append(exc)
        finally:
            held.set()
            loop.close()

    keeper = threading.Thread(target=run, name=f"lease-keeper-{node_id}", daemon=True)
    keeper.start()
    held.wait(timeout=30)
    try:
        if failures:
            raise failures[0]
        yield
    finally:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the keeper is done
            loop.call_soon_threadsafe(stop.set)
        keeper.join(timeout=30)


# -- network namespaces ----------------------------------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def require_netns() -> None:
    """The fencing test builds namespaces: root and `ip` are needed."""
    reason = None
    if os.geteuid() != 0:
        reason = "network namespaces need root"
    elif shutil.which("ip") is None:
        reason = "the ip command (iproute2) is not installed"
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


class Netns:
    """Network namespaces joined to the root namespace and to each other by veth pairs;
    names carry a random tag so that concurrent runs on one machine cannot collide."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.namespaces: list[str] = []
        self._root_links: list[str] = []
        self._used = self._subnets_in_use()

    def namespace(self, label: str) -> str:
        name = f"fila{self.tag}{label}"
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def link(self, label: str, left: str | None, right: str) -> tuple[str, str, str]:
        """A veth pair between `left` (None: the root namespace) and `right`, on a
        free /24; returns (left address, right address, right interface name)."""
        subnet = self._free_subnet()
        a, b = f"f{self.tag}{label}a", f"f{self.tag}{label}b"
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        if left is None:
            self._root_links.append(a)
        for iface, ns, host in ((a, left, 1), (b, right, 2)):
            if ns is not None:
                _ip("link", "set", iface, "netns", ns)
            prefix = ["-n", ns] if ns is not None else []
            _ip(*prefix, "addr", "add", f"{subnet}.{host}/24", "dev", iface)
            _ip(*prefix, "link", "set", iface, "up")
        return f"{subnet}.1", f"{subnet}.2", b

    def route(self, namespace: str, to: str, via: str) -> None:
        """In `namespace`, packets for the address `to` go through the neighbour `via`."""
        _ip("-n", namespace, "route", "add", f"{to}/32", "via", via)

    def set_link(self, namespace: str, iface: str, up: bool) -> None:
        _ip("-n", namespace, "link", "set", iface, "up" if up else "down")

    def wrapper(self, namespace: str) -> list[str]:
        return ["ip", "netns", "exec", namespace]

    def close(self) -> None:
        for name in self.namespaces:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", name)
        for link in self._root_links:  # gone with their peer's namespace, normally
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("link", "del", link)

    @staticmethod
    def _subnets_in_use() -> set[str]:
        shown = subprocess.run(
            ["ip", "-4", "route"], capture_output=True, text=True, timeout=10
        ).stdout
        return {line.split("/")[0].rsplit(".", 1)[0] for line in shown.splitlines() if "/" in line}

    def _free_subnet(self) -> str:
        for _ in range(1000):
            subnet = f"10.{secrets.randbelow(50) + 200}.{secrets.randbelow(250) + 1}"
            if subnet not in self._used:
                self._used.add(subnet)
                return subnet
        raise RuntimeError("no free 10.x.y.0/24 subnet")
