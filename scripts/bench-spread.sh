#!/usr/bin/env bash
# The spread study behind fila_bench/thresholds.toml: runs `fila-bench system` RUNS
# times (default 10) on one commit and prints, per figure, the median, range, largest
# single-run deviation from the median, CV, and the threshold a gated figure needs to
# stay clear of its own noise. Run it on an idle machine (the one that runs the gate)
# and copy the suggestions into thresholds.toml and docs/benchmarks.md.
#   scripts/bench-spread.sh [RUNS] [OUT_DIR]
#   BENCH_ARGS="--quick --only durable_*" scripts/bench-spread.sh 5
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
runs="${1:-10}"
out="${2:-bench-results/spread}"
export BENCH_ARGS="${BENCH_ARGS:---quick}"

# Each run is written as it finishes; a run that fails its checks still counts here,
# the failures are listed in its file.
BENCH_RUNS="$runs" "$here/scripts/bench-runs.sh" "$out" || echo "some runs reported failures" >&2
"$here/.venv/bin/fila-bench" spread "$out"/run-*.json --markdown "$out/spread.md"
echo "loadavg per run (start -> end):"
for f in "$out"/run-*.json; do
  "$here/.venv/bin/python" -c 'import json,sys; e=json.load(open(sys.argv[1]))["environment"]; print(sys.argv[1], e["loadavg_1m_start"], "->", e.get("loadavg_1m_end"), e.get("cpu_pinning"))' "$f"
done
