#!/usr/bin/env bash
# The repository's .venv (scripts/setup.sh) plus the optional `bench` extra: the other
# brokers' Python clients and matplotlib. Re-installs only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
stamp=.venv/.fila-bench-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  # only adds the extra: what scripts/setup.sh installed stays as it is
  .venv/bin/python -m pip install --quiet -e '.[bench]'
  echo "$want" > "$stamp"
fi
