#!/usr/bin/env bash
# CI's proof that the competitive harness works end to end (never a speed gate: these
# machines are noisy). Installs what it needs (the `bench` extra, redis-server from
# Debian), type-checks the harness, then runs the quick profile against Fila and
# Redis. run.py exits non-zero when any row fails its conservation check or errors;
# this script also checks that every output was written and follows the schema.
set -euo pipefail
cd "$(dirname "$0")/.."

bench-competitive/setup.sh
bench-competitive/install.sh redis
.venv/bin/mypy bench-competitive/competitive bench-competitive/run.py

out="$(mktemp -d -t fila-bench-smoke-XXXXXX)"
trap 'rm -rf "$out"' EXIT
.venv/bin/python bench-competitive/run.py --quick --brokers fila,redis --out "$out"

for f in summary.json RESULTS.md throughput_durable.png throughput_buffered.png batched.png latency.png; do
  if [[ ! -s "$out/$f" ]]; then
    echo "ci-smoke: $f was not written" >&2
    exit 1
  fi
done
.venv/bin/python - "$out/summary.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
assert list(data) == ["commit", "timestamp", "machine", "placement", "rows"], list(data)
rows = data["rows"]
brokers = {r["broker"] for r in rows}
assert brokers == {"fila", "redis"}, brokers
measured = [r for r in rows if not r["conservation"].startswith("not available")]
bad = [r for r in measured if r["conservation"] != "ok" or r["value"] is None]
assert not bad, bad
for workload in ("enqueue", "drain", "latency_p50", "latency_p99", "latency_p999"):
    for broker in brokers:
        assert any(r["broker"] == broker and r["workload"] == workload and r["value"] for r in measured), (broker, workload)
print(f"ci-smoke: {len(rows)} rows, {len(measured)} measured, all conserved")
PY
