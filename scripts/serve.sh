#!/usr/bin/env bash
# Sets up (first run only: the runtime dependencies, not the dev tools) and runs the
# broker on its built-in defaults: listens on 127.0.0.1:5555, stores data in ./data,
# fsyncs before answering. Extra arguments go to fila-server (e.g. --config fila.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --runtime
exec .venv/bin/fila-server "$@"
