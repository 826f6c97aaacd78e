#!/usr/bin/env python3
"""One load against two brokers that differ in one setting, alternating: A, B, B, A, ...

    .venv/bin/python scripts/ab_brokers.py LOAD [--rounds 6] [--seconds 4]
        [--a-toml TOML] [--b-toml TOML] [--b-pythonpath DIR] [--persist-mode sync]

LOAD is one of `scripts/profile_broker.py`'s loads (`unary50`, `sdk50`, `unary1`,
`sdk1`, `unary_lifecycle`, `batch`, `drain`; `drain` preloads a backlog with `batch`
for `--seconds` first, untimed). Both brokers run at once, each in its own
temporary directory, pinned to `--server-cpu` (this process to `--client-cpu`), and
only one is loaded at a time, so both see the same host; the order alternates each
round (ABBA...). Each side's config is the persist mode plus its TOML;
`--auth` runs both with a bootstrap key and loads them with a key of their own that
holds `produce` and `consume` on the load's queue (not a superadmin, so every call
is authenticated and checked against an ACL). `--b-pythonpath` runs B with that
directory first on its PYTHONPATH: the `fila` of
another checkout (`git worktree add --detach DIR REV`), to compare two commits, or a
`sitecustomize.py` that changes something from outside the product. Prints every
round's rate, each side's median, and B over A, with the broker's CPU microseconds
per message (from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_broker
from profile_broker import LOADS, _batch, _create_queue, tenant_key

from fila.testing.server import ServerProcess

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def start(
    tmp: Path, name: str, toml: str, mode: str, env: dict[str, str], cpu: int
) -> ServerProcess:
    server = ServerProcess(tmp / name / "data", config_toml=toml, persist_mode=mode, env=env)
    server.start()
    if cpu >= 0:
        subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(server.pid)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    return server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("load", choices=sorted(LOADS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--persist-mode", choices=("sync", "buffer"), default="sync")
    parser.add_argument("--a-toml", default="")
    parser.add_argument("--b-toml", default="")
    parser.add_argument("--b-pythonpath", default="")
    parser.add_argument("--auth", action="store_true")
    parser.add_argument("--server-cpu", type=int, default=1)
    parser.add_argument("--client-cpu", type=int, default=0)
    args = parser.parse_args()
    if args.client_cpu >= 0:
        os.sched_setaffinity(0, {args.client_cpu})
    b_env = {"PYTHONPATH": args.b_pythonpath} if args.b_pythonpath else {}
    load = LOADS[args.load]
    boot = "ab-bootstrap-key"
    if args.auth:
        auth = f'[auth]\nbootstrap_apikey = "{boot}"\n'
        args.a_toml, args.b_toml = args.a_toml + auth, args.b_toml + auth
    rates: dict[str, list[float]] = {"A": [], "B": []}
    cpu_us: dict[str, list[float]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="fila-ab-") as tmp:
        servers = {
            "A": start(Path(tmp), "a", args.a_toml, args.persist_mode, {}, args.server_cpu),
            "B": start(Path(tmp), "b", args.b_toml, args.persist_mode, b_env, args.server_cpu),
        }
        try:
            keys = {}
            for side, server in servers.items():
                profile_broker.use_key(boot if args.auth else None)
                asyncio.run(_create_queue(server.addr))
                keys[side] = asyncio.run(tenant_key(server.addr, boot)) if args.auth else None
            for index in range(args.rounds):
                order = ("A", "B") if index % 2 == 0 else ("B", "A")
                for side in order:
                    server = servers[side]
                    profile_broker.use_key(keys[side])
                    if args.load == "drain":  # a fresh backlog, untimed
                        asyncio.run(_batch(server.addr, time.monotonic() + args.seconds))
                    before = cpu_seconds(server.pid)
                    moved = asyncio.run(load(server.addr, time.monotonic() + args.seconds))
                    used = cpu_seconds(server.pid) - before
                    rates[side].append(moved / args.seconds)
                    cpu_us[side].append(1e6 * used / moved if moved else 0.0)
                    print(f"round {index + 1} {side}: {moved / args.seconds:10,.0f} msg/s, "
                          f"{cpu_us[side][-1]:6.1f} us CPU/msg", flush=True)  # fmt: skip
        finally:
            for server in servers.values():
                server.stop()
    a, b = statistics.median(rates["A"]), statistics.median(rates["B"])
    a_cpu, b_cpu = statistics.median(cpu_us["A"]), statistics.median(cpu_us["B"])
    print(f"median A {a:,.0f} msg/s ({a_cpu:.1f} us CPU/msg), "
          f"B {b:,.0f} msg/s ({b_cpu:.1f} us CPU/msg), B/A {b / a:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
