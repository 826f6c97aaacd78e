#!/usr/bin/env bash
# The one way to produce the generated stubs: fila/v1/*_pb2*.py{,i} from
# proto/fila/v1/*.proto (the public API) and fila/internal/v1/ from
# proto/fila/internal/v1/ (what cluster nodes say to each other).
# CI runs `scripts/gen_proto.sh --check` and fails when the committed stubs drift.
set -euo pipefail
cd "$(dirname "$0")/.."

DIRS=(fila/v1 fila/internal/v1)

generate() {
  local out="$1"
  for dir in "${DIRS[@]}"; do
    mkdir -p "$out/$dir"
    python -m grpc_tools.protoc -Iproto \
      --python_out="$out" --grpc_python_out="$out" \
      --mypy_out="$out" --mypy_grpc_out="$out" \
      proto/"$dir"/*.proto >/dev/null
  done
}

if [[ "${1:-}" == "--check" ]]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  generate "$tmp"
  status=0
  for dir in "${DIRS[@]}"; do
    for f in "$tmp/$dir"/*; do
      name="$(basename "$f")"
      if ! cmp -s "$f" "$dir/$name"; then
        echo "drift: $dir/$name differs from what proto/ generates; run scripts/gen_proto.sh" >&2
        status=1
      fi
    done
  done
  exit "$status"
fi

generate .
echo "generated ${DIRS[*]} stubs from proto/"
