#!/usr/bin/env bash
# Checks deploy/fila.service with `systemd-analyze verify` (syntax, directives, the
# executable) and prints its `systemd-analyze security` exposure summary.
# systemd resolves the unit's bare `fila-server` on its own search path, where a
# development checkout has none, so the check runs on a copy naming this
# checkout's .venv/bin/fila-server instead; every other line is checked as shipped.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v systemd-analyze >/dev/null; then
  echo "verify-unit: systemd-analyze not found (install the systemd package)" >&2
  exit 3
fi
server="$PWD/.venv/bin/fila-server"
if [[ ! -x "$server" ]]; then
  echo "verify-unit: $server missing; run scripts/setup.sh first" >&2
  exit 3
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
sed "s|^ExecStart=fila-server |ExecStart=$server |" deploy/fila.service > "$tmp/fila.service"
# verify exits 0 on some problems (an unknown or misspelt key is only a warning that
# systemd then ignores), so any output at all fails the check.
if ! out="$(systemd-analyze verify "$tmp/fila.service" 2>&1)" || [[ -n "$out" ]]; then
  printf 'verify-unit: systemd-analyze verify deploy/fila.service:\n%s\n' "$out" >&2
  exit 1
fi
# --offline needs systemd >= 250; older ones only analyse loaded units
if systemd-analyze security --help 2>/dev/null | grep -q -- '--offline'; then
  systemd-analyze security --offline=true --no-pager "$tmp/fila.service" | tail -n 1
fi
echo "verify-unit: deploy/fila.service OK"
