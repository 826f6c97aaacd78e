"""gRPC's process-wide settings for the broker, set on import, before gRPC's own.

gRPC reads `GRPC_EXPERIMENTS` once, when it is first imported, so `fila.server.main`
imports this module ahead of `grpc`, and nothing else imports it: SDK clients and the
benchmark's load generator keep gRPC's defaults.

`-event_engine_listener` serves connections from gRPC's older poller, which runs on
the thread that already waits for gRPC's events, instead of handing every read and
write to a pool of event-engine threads and back. That saves context switches and
broker CPU on every message (figures: docs/benchmarks.md, "gRPC's listener").
gRPC documents the variable as the way to turn the experiment
off. An operator's own `GRPC_EXPERIMENTS` is left as it is.

gRPC's C core writes its own lines to stderr, outside the broker's log format and
rate limits: at its default verbosity, one line per failed TLS handshake, so any
peer could fill the log's disk by failing handshakes in a loop (figures:
docs/benchmarks.md, "Measurements behind design choices"). `GRPC_VERBOSITY` is
set to `ERROR` unless the operator set it (`GRPC_VERBOSITY=INFO` brings those lines
back, to debug a client's connection).
"""

from __future__ import annotations

import os

BROKER_GRPC_EXPERIMENTS = "-event_engine_listener"

GRPC_EXPERIMENTS = os.environ.setdefault("GRPC_EXPERIMENTS", BROKER_GRPC_EXPERIMENTS)
GRPC_VERBOSITY = os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
