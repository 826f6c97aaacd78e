"""A deliberate slowdown of the broker's Enqueue handler, injected from outside Fila.

Used only by `scripts/bench-gate-demo.sh` to show that the benchmark gate catches a
real regression: put this directory on PYTHONPATH and set BENCH_SLOWDOWN_US, and
every broker process (`python -m fila.server.main` or `fila-server`; nothing else,
not the echo server nor the load generator) burns that many microseconds of CPU on
its event loop before each Enqueue / EnqueueBatch call, as extra Python work in the
handler would. It wraps the handler through a gRPC server interceptor added to
`grpc.aio.server`, so it needs no hook in `fila/` and keeps working while the
broker's internals change. Nothing here ships in the package.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

_SPIN_US = float(os.environ.get("BENCH_SLOWDOWN_US", "0") or 0)
_IS_BROKER = "fila.server.main" in sys.orig_argv or any(
    a.endswith("fila-server") for a in sys.orig_argv
)
_METHODS = ("/fila.v1.FilaService/Enqueue", "/fila.v1.FilaService/EnqueueBatch")


def _install() -> None:
    import grpc
    import grpc.aio

    spin_s = _SPIN_US / 1e6

    def slowed(behavior: Any) -> Any:
        async def wrapper(request: Any, context: Any) -> Any:
            until = time.perf_counter() + spin_s
            while time.perf_counter() < until:
                pass
            return await behavior(request, context)

        return wrapper

    class Slowdown(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            if handler is None or details.method not in _METHODS or not handler.unary_unary:
                return handler
            return handler._replace(unary_unary=slowed(handler.unary_unary))

    original = grpc.aio.server

    def server(*args: Any, interceptors: Any = None, **kwargs: Any) -> Any:
        chain = [*(interceptors or ()), Slowdown()]
        return original(*args, interceptors=chain, **kwargs)

    grpc.aio.server = server
    sys.stderr.write(f"sitecustomize: Enqueue slowed by {_SPIN_US:g} us per call\n")


if _IS_BROKER and _SPIN_US > 0:
    _install()
