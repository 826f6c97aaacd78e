"""A deliberate slowdown of the broker's Enqueue handler, injected from outside Fila.

Used only by `scripts/bench-gate-demo.sh` to show that the benchmark gate catches a
real regression: put this directory on PYTHONPATH and set BENCH_SLOWDOWN_US, and
every broker process (`python -m fila.server.main` or `fila-server`; nothing else,
not the echo server nor the load generator) burns that many microseconds of CPU on
its event loop before each Enqueue / EnqueueBatch call and before each request read
from a StreamEnqueue stream (the path the SDK's `enqueue` rides), as extra Python
work in the handler would. It wraps the handler through a gRPC server interceptor added to
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
_STREAMS = ("/fila.v1.FilaService/StreamEnqueue",)


def _install() -> None:
    import grpc
    import grpc.aio

    spin_s = _SPIN_US / 1e6

    def spin() -> None:
        until = time.perf_counter() + spin_s
        while time.perf_counter() < until:
            pass

    def slowed(behavior: Any) -> Any:
        async def wrapper(request: Any, context: Any) -> Any:
            spin()
            return await behavior(request, context)

        return wrapper

    def slowed_stream(behavior: Any) -> Any:
        async def each_slowed(requests: Any) -> Any:
            async for request in requests:
                spin()
                yield request

        async def wrapper(requests: Any, context: Any) -> Any:
            return await behavior(each_slowed(requests), context)

        return wrapper

    class Slowdown(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            if handler is None:
                return handler
            if details.method in _METHODS and handler.unary_unary:
                return handler._replace(unary_unary=slowed(handler.unary_unary))
            if details.method in _STREAMS and handler.stream_stream:
                return handler._replace(stream_stream=slowed_stream(handler.stream_stream))
            return handler

    original = grpc.aio.server

    def server(*args: Any, interceptors: Any = None, **kwargs: Any) -> Any:
        chain = [*(interceptors or ()), Slowdown()]
        return original(*args, interceptors=chain, **kwargs)

    grpc.aio.server = server
    sys.stderr.write(f"sitecustomize: Enqueue slowed by {_SPIN_US:g} us per call\n")


if _IS_BROKER and _SPIN_US > 0:
    _install()
