#!/usr/bin/env bash
# The one way to run the test suite: ./scripts/test.sh [pytest args...]
# Sets up .venv on first use, then runs pytest against real fila-server processes.
# Runs all of tests/ unless a test path (file, dir or file::node) is given.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

targets=(tests)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    targets=()
    break
  fi
done

exec .venv/bin/python -m pytest -q --timeout=300 "${targets[@]}" "$@"
