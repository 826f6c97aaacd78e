#!/usr/bin/env bash
# The spread study behind fila_bench/thresholds.toml: runs `fila-bench system` RUNS
# times (default 10) on one commit and prints, per figure, the median, range, largest
# single-run deviation from the median, CV, the worst gap between two medians of three
# (what the gate compares) and the threshold that clears it. Run it on the machine
# that runs the gate, in more than one session (hours apart), and pool the runs:
#   fila-bench spread first/run-*.json second/run-*.json
# then copy the suggestions into thresholds.toml and docs/benchmarks.md.
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
