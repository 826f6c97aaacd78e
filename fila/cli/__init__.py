"""The `fila` command: administer a broker, publish, browse and follow messages.

One module per command group (`queue`, `config`, `messages`, `redrive`, `health`,
`apikey`, `acl`), each a click group or command that `app` registers on the root;
the shared pieces are `context` (global options, `--json` on every command),
`errors` (one-line failures), `output` (JSON or rich tables), `connection` (address
checks, connect, diagnosis) and `raw` (the few calls made below the SDK's public
surface).

gRPC's C core writes its own log lines to stderr (a failed TLS handshake logs one
per attempt). They would break the promise that a failure is one line, so they are
switched off here, before anything imports grpc, which reads `GRPC_VERBOSITY` when
it initializes. `FILA_GRPC_VERBOSITY` (e.g. `DEBUG`) turns them back on for
debugging a connection.
"""

import os

os.environ["GRPC_VERBOSITY"] = os.environ.get("FILA_GRPC_VERBOSITY", "NONE")
if "FILA_GRPC_VERBOSITY" not in os.environ:
    os.environ.pop("GRPC_TRACE", None)

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fila.cli.app import cli, main

__all__ = ["cli", "main"]


def __getattr__(name: str) -> Any:
    """`cli` and `main`, imported on first use (so with the environment above set).

    Not imported eagerly: `fila.cli.app` registers `fila dashboard`, whose module uses
    a piece of this package (`fila.cli.durations`), so importing the dashboard first
    (`python -m fila.dashboard`) would otherwise be a circular import."""
    if name in __all__:
        from fila.cli import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
