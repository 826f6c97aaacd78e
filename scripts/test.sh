#!/usr/bin/env bash
# The one way to run the test suite: ./scripts/test.sh [pytest args...]
# Sets up .venv on first use, then runs pytest against real fila-server processes.
# Runs all of tests/ unless a test path (file, dir or file::node) is given.
# Test files run on FILA_TEST_WORKERS pytest-xdist workers (default 3; 0 runs them in
# this process): most of a test's time is spent waiting on the servers it starts, so
# three files at a time finish the suite in about half the time on 2 cores. A file's
# tests stay together on one worker (--dist loadfile): its module-scoped servers are
# started once.
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

workers="${FILA_TEST_WORKERS:-3}"
parallel=()
if [[ "$workers" != 0 ]]; then
  parallel=(-n "$workers" --dist loadfile)
fi

exec .venv/bin/python -m pytest -q --timeout=300 "${parallel[@]}" "${targets[@]}" "$@"
