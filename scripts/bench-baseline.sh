#!/usr/bin/env bash
# Builds the benchmark baseline of commit REV when CI found none saved for it:
# checks REV out into a temporary worktree, installs it into that worktree's own .venv
# (its scripts/setup.sh), and runs scripts/bench-runs.sh against it, so the baseline
# is REV's broker measured by REV's own harness, the median of BENCH_RUNS runs.
#   scripts/bench-baseline.sh REV OUT_DIR        (OUT_DIR/median.json, runs, charts)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
rev="${1:?usage: bench-baseline.sh REV OUT_DIR}"
out="$(mkdir -p "${2:?usage: bench-baseline.sh REV OUT_DIR}" && cd "$2" && pwd)"

tree="$(mktemp -d "${RUNNER_TEMP:-/tmp}/fila-baseline.XXXXXX")"
cleanup() { git -C "$here" worktree remove --force "$tree" >/dev/null 2>&1 || rm -rf "$tree"; }
trap cleanup EXIT

git -C "$here" worktree add --detach "$tree" "$rev" >/dev/null
echo "==> baseline: $(git -C "$tree" log -1 --format='%h %s')"
(cd "$tree" && scripts/setup.sh)
FILA_BENCH="$tree/.venv/bin/fila-bench" "$here/scripts/bench-runs.sh" "$out"
