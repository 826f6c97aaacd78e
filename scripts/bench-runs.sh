#!/usr/bin/env bash
# Runs `fila-bench system` BENCH_RUNS times (default 3), writes each run, their median
# (`fila-bench aggregate`) and charts of the median into OUT_DIR:
#   OUT_DIR/run-1.json ... run-N.json, OUT_DIR/median.json, OUT_DIR/charts/*.png
#
#   scripts/bench-runs.sh OUT_DIR
#   BENCH_RUNS=1 BENCH_ARGS="--quick" scripts/bench-runs.sh bench-results/ci
#
# BENCH_ARGS go to every `fila-bench system` (default: the full profile).
# FILA_BENCH names the fila-bench to run (default: this checkout's .venv), so the same
# script measures another checkout, as scripts/bench-baseline.sh does.
# Every run is made even if one fails its checks; the exit status is then 1 and the
# failures are carried into median.json, where `fila-bench compare` fails on them.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:?usage: bench-runs.sh OUT_DIR}"
runs="${BENCH_RUNS:-3}"
bench="${FILA_BENCH:-$here/.venv/bin/fila-bench}"
read -r -a args <<< "${BENCH_ARGS:-}"

mkdir -p "$out"
status=0
inputs=()
for i in $(seq 1 "$runs"); do
  echo "==> fila-bench system run $i/$runs ${args[*]}"
  if ! "$bench" system "${args[@]}" --out "$out/run-$i.json"; then
    echo "run $i reported failed benchmarks (see above); continuing" >&2
    status=1
  fi
  # A run that crashed before writing its file is a failure, not a smaller median.
  if [[ -f "$out/run-$i.json" ]]; then inputs+=("$out/run-$i.json"); else status=1; fi
done
[[ ${#inputs[@]} -gt 0 ]] || { echo "no run produced results" >&2; exit 1; }
"$here/.venv/bin/fila-bench" aggregate "$out/median.json" "${inputs[@]}"
"$here/.venv/bin/fila-bench" charts "$out/median.json" "$out/charts"
exit "$status"
