#!/usr/bin/env python3
"""The auth interceptor's own CPU per unary call, in-process: what a call costs it
with the per-key reuse (`fila.server.auth`, `fila.security.keyring`) and without.

    .venv/bin/python scripts/auth_per_call.py [--calls 20000] [--rounds 7]

A keyring with one key that may produce on one queue among `--patterns` grants (the
ACL a tenant's key might hold); each call goes through `AuthInterceptor.
intercept_service` and the wrapper's admission check, as gRPC would drive them, with
a handler that does nothing. "Without" rebuilds the wrapper and re-matches the ACL on
every call, as before the reuse (set here, from outside the product). Rounds
alternate; prints the median microseconds per call of each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any

import grpc

from fila.clock import ManualClock
from fila.security import keyring as keyring_module
from fila.security.acl import covers
from fila.security.keyring import Keyring
from fila.security.keystore import LocalKeyStore
from fila.server import access
from fila.server import auth as auth_module
from fila.storage.backend import MemoryStorage
from fila.storage.committer import Committer
from fila.v1 import service_pb2

METHOD = "/fila.v1.FilaService/Enqueue"
BOOT = "auth-per-call-bootstrap"


@dataclass
class _Details:
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class _Context:
    def __init__(self) -> None:
        self.aborted = False

    async def abort(self, code: Any, details: str) -> None:
        self.aborted = True
        raise RuntimeError(details)


async def _behaviour(request: Any, context: Any) -> None:
    return None


async def measure(calls: int, rounds: int, patterns: int) -> dict[str, list[float]]:
    committer = Committer(MemoryStorage(), "buffer", lambda exc: None)
    keyring = Keyring(LocalKeyStore(MemoryStorage(), committer), ManualClock(), BOOT)
    record, key, written = keyring.create(None, "tenant", 0, False)
    await written
    grants = [("produce", f"other{i}.*") for i in range(patterns - 1)] + [("produce", "q")]
    await keyring.set_acl(None, record.key_id, grants)
    handler = grpc.unary_unary_rpc_method_handler(_behaviour)

    async def continuation(details: Any) -> Any:
        return handler

    details = _Details(METHOD, (("authorization", f"Bearer {key}"),))
    request = service_pb2.EnqueueRequest(queue="q")
    context = _Context()
    cached_authorized = auth_module._HandlerCache.authorized
    cached_permits = keyring_module._KeyState.permits

    def uncached_authorized(self: Any, method: str, handler: Any, caller: Any) -> Any:
        return auth_module._authorized(handler, caller, access.rule_for(method))

    def uncached_permits(self: Any, kind: Any, queue: str) -> bool:
        return covers(self.permissions, kind, queue)

    async def one_round() -> float:
        interceptor = auth_module.AuthInterceptor(keyring)
        started = time.perf_counter()
        for _ in range(calls):
            wrapped = await interceptor.intercept_service(continuation, details)  # type: ignore[arg-type]
            await wrapped.unary_unary(request, context)
        return 1e6 * (time.perf_counter() - started) / calls

    out: dict[str, list[float]] = {"reused": [], "rebuilt": []}
    for index in range(rounds):
        order = ("reused", "rebuilt") if index % 2 == 0 else ("rebuilt", "reused")
        for kind in order:
            reuse = kind == "reused"
            auth_module._HandlerCache.authorized = (  # type: ignore[method-assign]
                cached_authorized if reuse else uncached_authorized
            )
            keyring_module._KeyState.permits = (  # type: ignore[method-assign]
                cached_permits if reuse else uncached_permits
            )
            out[kind].append(await one_round())
    auth_module._HandlerCache.authorized = cached_authorized  # type: ignore[method-assign]
    keyring_module._KeyState.permits = cached_permits  # type: ignore[method-assign]
    assert not context.aborted
    committer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--patterns", type=int, default=5, help="grants in the key's ACL")
    args = parser.parse_args()
    out = asyncio.run(measure(args.calls, args.rounds, args.patterns))
    for kind, values in out.items():
        print(f"{kind}: {statistics.median(values):.2f} us per call (rounds: "
              + ", ".join(f"{v:.2f}" for v in values) + ")")  # fmt: skip


if __name__ == "__main__":
    main()
