#!/usr/bin/env bash
# Idempotent setup: a .venv with Fila, its dashboard and its dev tools, from pyproject.toml.
# Re-installs only when pyproject.toml changed since the last successful install.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ! -x .venv/bin/python ]]; then
  if ! python3 -m venv .venv 2>/dev/null; then
    # Debian ships venv/ensurepip separately
    rm -rf .venv
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-pip
    python3 -m venv .venv
  fi
fi

stamp=.venv/.fila-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d" " -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev,dashboard]'
  echo "$want" > "$stamp"
fi
