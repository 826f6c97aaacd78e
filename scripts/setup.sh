#!/usr/bin/env bash
# Idempotent setup of .venv from pyproject.toml:
#   scripts/setup.sh            Fila with its dashboard and dev tools (tests, linters, CI)
#   scripts/setup.sh --runtime  Fila's runtime only (what scripts/serve.sh needs), with
#                               pip's progress shown
# Re-installs only when pyproject.toml or this script changed since the last successful
# install, or when the installed set lacks what is asked for (a dev install serves both).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/system.sh
source scripts/system.sh

want_extras=dev
if [[ "${1:-}" == "--runtime" ]]; then
  want_extras=runtime
elif [[ $# -gt 0 ]]; then
  echo "usage: scripts/setup.sh [--runtime]" >&2
  exit 2
fi

if [[ ! -x .venv/bin/python ]]; then
  if ! command -v python3 >/dev/null; then
    apt_install python3 python3-venv python3-pip
  fi
  if ! python3 -m venv .venv 2>/dev/null; then
    # Debian ships venv/ensurepip separately
    rm -rf .venv
    apt_install python3-venv python3-pip
    python3 -m venv .venv
  fi
fi

stamp=.venv/.fila-installed
hash="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d" " -f1)"
have_hash="" have_extras=""
if [[ -f "$stamp" ]]; then
  read -r have_hash have_extras <"$stamp" || true
fi
if [[ "${have_hash:-}" == "$hash" ]] && [[ "${have_extras:-dev}" == dev || "$want_extras" == runtime ]]; then
  exit 0
fi
if [[ "$want_extras" == runtime ]]; then
  echo "fila: installing the broker's runtime dependencies into .venv (first run only;" \
    "a minute or two)" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --progress-bar on -e . >&2
else
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev,dashboard]'
fi
echo "$hash $want_extras" >"$stamp"
