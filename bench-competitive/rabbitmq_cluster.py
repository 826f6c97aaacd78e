#!/usr/bin/env python3
"""RabbitMQ quorum queues on a three-node cluster on this machine: the replication cells
of `fila-bench system` (fila_bench/benchmarks/replication.py), for docs/benchmarks.md.

    .venv/bin/python bench-competitive/rabbitmq_cluster.py [--quick] [--out FILE]

Three `rabbitmq-server` nodes (Debian's package, started unprivileged as the
competitive harness's adapter does: `competitive/adapters/rabbitmq.py`) with node names
`fbq1..3@localhost`, their own AMQP and distribution ports, and one `epmd` on a port of
their own that this script starts in the foreground (so it ends with them); nodes 2
and 3 join node 1 (`rabbitmqctl join_cluster`). Messages are persistent, 1 KB,
published with publisher confirms (aio-pika), as the harness publishes.

- enqueue: a quorum queue of three members (`x-quorum-initial-group-size` 3) against
  one of a single member (the unreplicated counterpart), both led by node 1 and loaded
  there, in alternating windows: 50 connections with one publish in flight each
  (`_50c`), and one connection with 256 publishes in flight (`_batched`, the confirm
  window standing for the SDK's 256 concurrent enqueues);
- failover: the node leading the three-member queue is killed with SIGKILL; the time
  until a publish through another node is confirmed (each attempt on a fresh
  connection, given up after 1 s). The node is started again and the next kill waits
  until it is a member in sync again. Median and worst;
- catch-up: one follower stopped (`rabbitmqctl stop_app`), N messages published, the
  node started again (`start_app`): the time from its start until `rabbitmq-queues
  quorum_status` shows its last written index at the leader's. Each `rabbitmqctl` call takes about a
  second here, so this is an upper bound (a lower bound on the rate).

Prints the figures as JSON. Every node is stopped (SIGKILL of its process group) and
its directory removed on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import aio_pika
import aio_pika.abc
from aio_pika import DeliveryMode, Message

BIN: Final = Path("/usr/lib/rabbitmq/bin")
PAYLOAD: Final = b"x" * 1024
CONNECTIONS: Final = 50
WINDOW: Final = 256
ATTEMPT_S: Final = 1.0
DEADLINE_S: Final = 120.0


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


class Node:
    def __init__(self, root: Path, index: int, epmd_port: int, ctl_port: int) -> None:
        self.index = index
        self.name = f"fbq{index}@localhost"
        self.dir = root / f"node{index}"
        self.dir.mkdir(parents=True)
        self.amqp_port, self.dist_port = _free_ports(2)
        self.env = {
            **os.environ,
            "HOME": str(root),  # the shared Erlang cookie
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.amqp_port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CTL_DIST_PORT_MIN": str(ctl_port),
            "RABBITMQ_CTL_DIST_PORT_MAX": str(ctl_port + 10),
            "ERL_EPMD_PORT": str(epmd_port),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(self.dir / "rabbitmq.pid"),
        }
        (self.dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.amqp_port}\n"
            "loopback_users = none\nlog.console = false\nlog.file.level = warning\n"
            "disk_free_limit.absolute = 50MB\n"
        )
        (self.dir / "advanced.config").write_text("[].\n")
        (self.dir / "enabled_plugins").write_text("[].\n")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.dir / "server.log", "ab") as out:
            self.process = subprocess.Popen(
                [str(BIN / "rabbitmq-server")],
                env=self.env,
                cwd=self.dir,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.dir / 'server.log'}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.amqp_port), 1) as sock,
            ):
                sock.sendall(b"AMQP\x00\x00\x09\x01")
                if sock.recv(1) == b"\x01":
                    return
            time.sleep(0.1)  # polling the AMQP port against a deadline
        raise TimeoutError(f"{self.name} did not accept AMQP within {DEADLINE_S}s")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def ctl(self, *args: str, tool: str = "rabbitmqctl") -> str:
        done = subprocess.run(
            [str(BIN / tool), "-n", self.name, *args],
            env=self.env,
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} on {self.name}: {done.stderr}")
        return done.stdout

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.amqp_port}/"


@contextlib.contextmanager
def cluster() -> Iterator[list[Node]]:
    root = Path(tempfile.mkdtemp(prefix="fila-rabbitmq-cluster-"))
    epmd_port, ctl_port = _free_ports(2)
    epmd = subprocess.Popen(
        ["epmd", "-port", str(epmd_port), "-address", "127.0.0.1"],
        env={**os.environ, "HOME": str(root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    nodes = [Node(root, i, epmd_port, ctl_port) for i in (1, 2, 3)]
    try:
        for node in nodes:
            node.start()
        for node in nodes[1:]:
            node.ctl("stop_app")
            node.ctl("join_cluster", nodes[0].name)
            node.ctl("start_app")
            node.wait_ready()
        yield nodes
    finally:
        for node in nodes:
            node.kill()
        epmd.kill()
        epmd.wait(10)
        shutil.rmtree(root, ignore_errors=True)


async def _declare(url: str, queue: str, members: int) -> None:
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(
            queue,
            durable=True,
            arguments={"x-queue-type": "quorum", "x-quorum-initial-group-size": members},
        )


async def _depth(url: str, queue: str) -> int:
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def _publisher(
    url: str,
) -> tuple[aio_pika.abc.AbstractConnection, aio_pika.abc.AbstractChannel]:
    connection = await aio_pika.connect(url, timeout=10)
    channel = await connection.channel(publisher_confirms=True)
    return connection, channel


async def _publish(channel: aio_pika.abc.AbstractChannel, queue: str) -> None:
    await channel.default_exchange.publish(
        Message(PAYLOAD, delivery_mode=DeliveryMode.PERSISTENT), routing_key=queue
    )


async def _window(
    url: str, queue: str, connections: int, in_flight: int, seconds: float
) -> tuple[float, int]:
    """Confirmed publishes per second over `seconds` (after a 0.5 s warmup), and all
    confirmed publishes."""
    opened = [await _publisher(url) for _ in range(connections)]
    counted = done = 0
    start = time.perf_counter() + 0.5
    end = start + seconds

    async def loop(channel: aio_pika.abc.AbstractChannel) -> None:
        nonlocal counted, done
        while time.perf_counter() < end:
            await _publish(channel, queue)
            done += 1
            if time.perf_counter() >= start:
                counted += 1

    try:
        await asyncio.gather(
            *(loop(opened[i % connections][1]) for i in range(connections * in_flight))
        )
    finally:
        for connection, _ in opened:
            await connection.close()
    return counted / seconds, done


async def enqueue_cells(nodes: list[Node], rounds: int, seconds: float) -> dict[str, Any]:
    url = nodes[0].url
    await _declare(url, "q3", 3)
    await _declare(url, "q1", 1)
    rates: dict[str, list[float]] = {}
    published = {"q1": 0, "q3": 0}
    for _ in range(rounds):
        for cell, (connections, in_flight) in {
            "50c": (CONNECTIONS, 1),
            "batched": (1, WINDOW),
        }.items():
            for queue in ("q1", "q3"):
                rate, done = await _window(url, queue, connections, in_flight, seconds)
                rates.setdefault(f"{queue}_{cell}", []).append(rate)
                published[queue] += done
    for queue, count in published.items():
        depth = await _depth(url, queue)
        if depth != count:
            raise RuntimeError(f"{queue}: {count} publishes confirmed, {depth} in the queue")
    out: dict[str, Any] = {}
    for cell in ("50c", "batched"):
        rf1 = statistics.median(rates[f"q1_{cell}"])
        rf3 = statistics.median(rates[f"q3_{cell}"])
        out[f"rabbitmq_quorum1_{cell}"] = round(rf1)
        out[f"rabbitmq_quorum3_{cell}"] = round(rf3)
        out[f"rabbitmq_3_over_1_{cell}"] = round(rf3 / rf1, 3)
        out[f"rabbitmq_rates_{cell}"] = {
            k: [round(r) for r in v] for k, v in rates.items() if k.endswith(cell)
        }
    return out


def _status(node: Node, queue: str) -> list[dict[str, Any]]:
    raw = node.ctl("quorum_status", queue, "--formatter", "json", tool="rabbitmq-queues")
    rows: list[dict[str, Any]] = json.loads(raw)
    return rows


def _leader(node: Node, queue: str) -> str:
    for row in _status(node, queue):
        if row.get("Raft State") == "leader":
            return str(row["Node Name"])
    raise RuntimeError(f"{queue}: no leader in quorum_status")


def _caught_up(node: Node, queue: str, member: str) -> bool:
    rows = {str(r["Node Name"]): r for r in _status(node, queue)}
    leader = next((r for r in rows.values() if r.get("Raft State") == "leader"), None)
    mine = rows.get(member)
    if leader is None or mine is None or mine.get("Raft State") not in ("follower", "leader"):
        return False
    return bool(mine.get("Last Written") == leader.get("Last Written"))


async def failover(nodes: list[Node], kills: int) -> dict[str, Any]:
    await _declare(nodes[0].url, "fo", 3)
    by_name = {node.name: node for node in nodes}
    timings: list[float] = []
    confirmed = 0
    for _ in range(kills):
        leader = by_name[await asyncio.to_thread(_leader, nodes[0], "fo")]
        entry = next(n for n in nodes if n is not leader)
        connection, channel = await _publisher(entry.url)
        for _ in range(20):
            await _publish(channel, "fo")
        confirmed += 20
        await connection.close()
        killed_at = time.perf_counter()
        await asyncio.to_thread(leader.kill)
        while time.perf_counter() - killed_at < DEADLINE_S:
            try:
                connection, channel = await _publisher(entry.url)
                try:
                    await asyncio.wait_for(_publish(channel, "fo"), ATTEMPT_S)
                    break
                finally:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(connection.close(), 5)
            except (TimeoutError, aio_pika.exceptions.AMQPException, ConnectionError):
                await asyncio.sleep(0.01)  # retry pacing
        else:
            raise TimeoutError("no publish confirmed after the kill")
        timings.append((time.perf_counter() - killed_at) * 1000)
        confirmed += 1
        await asyncio.to_thread(leader.start)
        back_at = time.perf_counter()
        while not await asyncio.to_thread(_caught_up, entry, "fo", leader.name):
            if time.perf_counter() - back_at > DEADLINE_S:
                raise TimeoutError(f"{leader.name} did not catch up")
            await asyncio.sleep(0.2)  # polling quorum_status against a deadline
    depth = await _depth(nodes[0].url, "fo")
    if depth < confirmed:
        raise RuntimeError(f"failover: {confirmed} confirmed, {depth} in the queue")
    return {
        "rabbitmq_failover_ms": round(statistics.median(timings)),
        "rabbitmq_failover_max_ms": round(max(timings)),
        "rabbitmq_failover_all_ms": [round(t) for t in timings],
    }


async def catchup(nodes: list[Node], count: int) -> dict[str, Any]:
    await _declare(nodes[0].url, "cu", 3)
    follower = nodes[2]
    await asyncio.to_thread(follower.ctl, "stop_app")
    connection, channel = await _publisher(nodes[0].url)
    try:
        sent = 0
        while sent < count:
            batch = min(WINDOW, count - sent)
            await asyncio.gather(*(_publish(channel, "cu") for _ in range(batch)))
            sent += batch
    finally:
        await connection.close()
    await asyncio.to_thread(follower.ctl, "start_app")
    started = time.perf_counter()  # the node serves again: as fila-bench's catch-up
    while not await asyncio.to_thread(_caught_up, nodes[0], "cu", follower.name):
        if time.perf_counter() - started > DEADLINE_S:
            raise TimeoutError("the follower did not catch up")
        await asyncio.sleep(0.05)  # polling quorum_status against a deadline
    took = time.perf_counter() - started
    return {
        "rabbitmq_catchup_log_msg_s": round(count / took),
        "rabbitmq_catchup_log_mb_s": round(count * len(PAYLOAD) / 1e6 / took, 2),
        "rabbitmq_catchup_s": round(took, 2),
    }


def _version() -> str:
    return subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", "rabbitmq-server"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout


async def main_async(quick: bool) -> dict[str, Any]:
    with cluster() as nodes:
        report: dict[str, Any] = {"rabbitmq": await asyncio.to_thread(_version)}
        report |= await enqueue_cells(nodes, 1 if quick else 3, 2.0 if quick else 5.0)
        report |= await catchup(nodes, 3_000 if quick else 20_000)
        report |= await failover(nodes, 2 if quick else 5)
        return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="one round, short windows")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    report = asyncio.run(main_async(args.quick))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
