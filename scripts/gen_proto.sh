#!/usr/bin/env bash
# The one way to produce fila/v1/*_pb2*.py{,i} from proto/fila/v1/*.proto.
# CI runs `scripts/gen_proto.sh --check` and fails when the committed stubs drift.
set -euo pipefail
cd "$(dirname "$0")/.."

generate() {
  local out="$1"
  mkdir -p "$out/fila/v1"
  python -m grpc_tools.protoc -Iproto \
    --python_out="$out" --grpc_python_out="$out" \
    --mypy_out="$out" --mypy_grpc_out="$out" \
    proto/fila/v1/messages.proto proto/fila/v1/service.proto proto/fila/v1/admin.proto >/dev/null
}

if [[ "${1:-}" == "--check" ]]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  generate "$tmp"
  status=0
  for f in "$tmp"/fila/v1/*; do
    name="$(basename "$f")"
    if ! cmp -s "$f" "fila/v1/$name"; then
      echo "drift: fila/v1/$name differs from what proto/ generates; run scripts/gen_proto.sh" >&2
      status=1
    fi
  done
  exit "$status"
fi

generate .
echo "generated fila/v1 stubs from proto/fila/v1"
