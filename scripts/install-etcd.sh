#!/usr/bin/env bash
# Installs Debian's etcd-server (etcd 3.4, /usr/bin/etcd) for cluster mode's tests and
# benchmark, which start their own etcd members on free ports with their own data
# directories (fila.testing.etcd) and never use a system etcd: where an init
# system starts the package's service, it is stopped again. Idempotent; uses sudo
# when not root (scripts/system.sh). Also makes sure `ip` (iproute2) is there: the
# fencing test builds network namespaces.
set -euo pipefail
# shellcheck source=scripts/system.sh
source "${BASH_SOURCE[0]%/*}/system.sh"

if ! command -v etcd >/dev/null || ! command -v ip >/dev/null; then
  apt_install etcd-server iproute2
  if command -v systemctl >/dev/null; then
    sudo_if_needed systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
fi
etcd --version | sed -n 1p  # sed reads to the end: head could SIGPIPE etcd (exit 141 under pipefail)
