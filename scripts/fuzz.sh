#!/usr/bin/env bash
# A long run of the wire fuzzer (tests/test_fuzz_wire.py): every fila.v1 RPC against a
# real broker, with arbitrary and mutated bytes. ./scripts/fuzz.sh [EXAMPLES] (default
# 20000; the test suite runs 200). A failure prints the call to replay.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
FILA_FUZZ_EXAMPLES="${1:-20000}" exec .venv/bin/python -m pytest -q -p no:cacheprovider \
  --timeout=0 tests/test_fuzz_wire.py
