#!/usr/bin/env bash
# Runs the competitive harness (bench-competitive/run.py) into OUT_DIR, or says
# plainly that there is none yet and exits 0, so the workflow and .ci/run can call it
# before the harness lands.
#   scripts/bench-competitive.sh --quick|--full OUT_DIR [BROKERS]
# BROKERS (comma-separated, e.g. fila,redis) limits the run; default: all five.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
usage="usage: bench-competitive.sh --quick|--full OUT_DIR"
case "${1:-}" in
  --quick) quick=(--quick) ;;
  --full) quick=() ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
out="${2:?$usage}"
brokers=()
if [[ -n "${3:-}" ]]; then
  brokers=(--brokers "$3")
fi

if [[ ! -f "$here/bench-competitive/run.py" ]]; then
  echo "bench-competitive/run.py does not exist: no competitive harness to run, skipping."
  exit 0
fi
# The harness's own install step (the other brokers, from Debian) and Python extra.
if [[ -x "$here/bench-competitive/install.sh" ]]; then
  "$here/bench-competitive/install.sh"
fi
if grep -q '^bench = \[' "$here/pyproject.toml"; then
  "$here/.venv/bin/python" -m pip install --quiet -e "$here[bench]"
fi
mkdir -p "$out"
"$here/.venv/bin/python" "$here/bench-competitive/run.py" "${quick[@]}" "${brokers[@]}" --out "$out"
