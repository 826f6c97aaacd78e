#!/usr/bin/env bash
# The gate: compares NEW with BASE (`fila-bench compare`, BENCH_THRESHOLD percent,
# default 10, raised per figure by fila_bench/thresholds.toml) and writes the table
# as Markdown to OUT_DIR/compare.md for the pull-request comment and, in GitHub
# Actions, for the job summary. Exits 1 on a regression or a failed benchmark.
#   scripts/bench-compare.sh BASE.json NEW.json OUT_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
base="${1:?usage: bench-compare.sh BASE.json NEW.json OUT_DIR}"
new="${2:?usage: bench-compare.sh BASE.json NEW.json OUT_DIR}"
out="${3:?usage: bench-compare.sh BASE.json NEW.json OUT_DIR}"
mkdir -p "$out"

status=0
"$here/.venv/bin/fila-bench" compare "$base" "$new" "${BENCH_THRESHOLD:-10}" \
  --markdown "$out/compare.md" || status=$?
if [[ -n "${GITHUB_STEP_SUMMARY:-}" && -f "$out/compare.md" ]]; then
  cat "$out/compare.md" >> "$GITHUB_STEP_SUMMARY"
fi
exit "$status"
