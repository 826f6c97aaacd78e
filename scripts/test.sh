#!/usr/bin/env bash
# The one way to run the test suite: ./scripts/test.sh [pytest args...]
# Uses .venv when present (as .ci/run creates it), else the python3 on PATH.
# Runs all of tests/ unless a test path (file, dir or file::node) is given.
set -euo pipefail
cd "$(dirname "$0")/.."

py=python3
if [[ -x .venv/bin/python ]]; then
  py=.venv/bin/python
fi

targets=(tests)
for arg in "$@"; do
  if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
    targets=()
    break
  fi
done

exec "$py" -m pytest -q -x --timeout=300 "${targets[@]}" "$@"
