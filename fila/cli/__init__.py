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

# Imported only now, with the environment set.
from fila.cli.app import cli, main

__all__ = ["cli", "main"]
