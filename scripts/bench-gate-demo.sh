#!/usr/bin/env bash
# Shows that the benchmark gate passes an unchanged commit and fails a real slowdown:
#  1. baseline: the median of BENCH_RUNS runs (default 3) of this commit;
#  2. TRIALS times (default 10): another median of BENCH_RUNS runs of the same commit,
#     compared with the baseline exactly as CI does (scripts/bench-compare.sh): each
#     should pass;
#  3. once more with a deliberate slowdown of the broker's Enqueue handler, injected
#     from outside the product by scripts/slowdown/sitecustomize.py on the broker's
#     PYTHONPATH: it should fail. The spin per Enqueue is SLOWDOWN_PCT (default 30)
#     percent of the broker's time per message at durable_enqueue_50c in the
#     baseline, converted so that a broker-bound rate drops by that percentage.
# Prints one line per comparison and a summary; exits 0 only if every unchanged trial
# passed and the slowed one failed.
#   scripts/bench-gate-demo.sh [OUT_DIR]
#   TRIALS=3 BENCH_ARGS="--quick --only echo_ceiling_50c,durable_*" scripts/bench-gate-demo.sh
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-bench-results/gate-demo}"
trials="${TRIALS:-10}"
pct="${SLOWDOWN_PCT:-30}"
export BENCH_ARGS="${BENCH_ARGS:---quick}"
export BENCH_RUNS="${BENCH_RUNS:-3}"
py="$here/.venv/bin/python"
mkdir -p "$out"

echo "==> baseline"
"$here/scripts/bench-runs.sh" "$out/base" > "$out/base.log" 2>&1 || true

passed=0
for t in $(seq 1 "$trials"); do
  "$here/scripts/bench-runs.sh" "$out/trial-$t" > "$out/trial-$t.log" 2>&1 || true
  if "$here/scripts/bench-compare.sh" "$out/base/median.json" "$out/trial-$t/median.json" \
      "$out/trial-$t" > "$out/trial-$t.compare.log" 2>&1; then
    passed=$((passed + 1)); echo "unchanged trial $t: pass"
  else
    echo "unchanged trial $t: FAIL ($(grep -o 'regression(s) past.*\|FAILED' "$out/trial-$t.compare.log" | head -1))"
  fi
done

# Broker time per message at the durable 50-connection rate; a spin of
# t * pct / (100 - pct) per message makes a broker-bound rate pct percent lower.
spin_us="$("$py" -c '
import json, sys
rate = {b["name"]: b["value"] for b in json.load(open(sys.argv[1]))["benchmarks"]}
pct = float(sys.argv[2])
print(round(1e6 / rate["durable_enqueue_50c"] * pct / (100 - pct), 1))
' "$out/base/median.json" "$pct")"
echo "==> slowdown: ${spin_us} us of CPU per Enqueue in the broker (${pct}% of a broker-bound rate)"
PYTHONPATH="$here/scripts/slowdown${PYTHONPATH:+:$PYTHONPATH}" BENCH_SLOWDOWN_US="$spin_us" \
  "$here/scripts/bench-runs.sh" "$out/slowed" > "$out/slowed.log" 2>&1 || true
slowed_failed=0
if "$here/scripts/bench-compare.sh" "$out/base/median.json" "$out/slowed/median.json" \
    "$out/slowed" > "$out/slowed.compare.log" 2>&1; then
  echo "slowed: pass (the gate MISSED the slowdown)"
else
  slowed_failed=1
  echo "slowed: FAIL, as it should ($(grep -o 'regression(s) past.*' "$out/slowed.compare.log" | head -1))"
fi
echo "summary: unchanged passed $passed/$trials; slowed $([[ $slowed_failed == 1 ]] && echo failed || echo passed)"
[[ $passed == "$trials" && $slowed_failed == 1 ]]
