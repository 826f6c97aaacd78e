#!/usr/bin/env bash
# Builds Fila's wheel (python -m build), installs it into a fresh virtualenv with its
# runtime dependencies only, and checks the installed package: `fila-server` starts and
# answers `fila health`, `fila-bench` runs, and no optional dependency came along.
# Usage: scripts/check-wheel.sh [WORKDIR]   (default: a temporary directory, removed)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
python="${PYTHON:-.venv/bin/python}"

server_pid=""
stop_server() {
  if [[ -n "$server_pid" ]]; then
    kill -TERM "$server_pid" 2>/dev/null || true
  fi
}
work="${1:-}"
if [[ -z "$work" ]]; then
  work="$(mktemp -d)"
  trap 'stop_server; rm -rf "$work"' EXIT
else
  mkdir -p "$work"
  trap stop_server EXIT
fi

echo "wheel: building into $work/dist"
"$python" -m build --wheel --outdir "$work/dist" "$repo" >"$work/build.log" 2>&1 || {
  tail -n 40 "$work/build.log" >&2
  exit 1
}
wheel="$(ls "$work"/dist/fila-*.whl)"
echo "wheel: $(basename "$wheel"), $(du -k "$wheel" | cut -f1) KiB"

python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$wheel"
for optional in starlette pytest mypy matplotlib redis; do
  if "$work/venv/bin/python" -c "import $optional" 2>/dev/null; then
    echo "wheel: the runtime install pulled in $optional, which belongs to an extra" >&2
    exit 1
  fi
done
echo "wheel: installed runtime-only, venv $(du -sm "$work/venv" | cut -f1) MB"

port="$("$work/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
cd "$work"  # not the repository: the installed package must stand on its own
FILA_LISTEN_ADDR="127.0.0.1:$port" FILA_DATA_DIR="$work/data" \
  "$work/venv/bin/fila-server" >"$work/server.log" 2>&1 &
server_pid=$!
deadline=$((SECONDS + 60))
until "$work/venv/bin/fila" --addr "127.0.0.1:$port" health >/dev/null 2>&1; do
  if ((SECONDS >= deadline)) || ! kill -0 "$server_pid" 2>/dev/null; then
    echo "wheel: the installed fila-server did not answer fila health within 60s" >&2
    tail -n 20 "$work/server.log" >&2
    exit 1
  fi
  sleep 0.2
done
"$work/venv/bin/fila" --addr "127.0.0.1:$port" health
"$work/venv/bin/fila-bench" --help >/dev/null
kill -TERM "$server_pid"
wait "$server_pid"
server_pid=""
echo "wheel: OK (fila-server answered fila health; fila and fila-bench run)"
