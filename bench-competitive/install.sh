#!/usr/bin/env bash
# Installs the brokers under test from Debian packages, only those that are missing.
# No containers run on these machines, so each broker is the distribution's own build;
# the runner starts every one itself (loopback, free port, temp data dir), so the
# packages' system services are stopped and disabled right after installation.
#   bench-competitive/install.sh [redis nats rabbitmq beanstalkd]   (default: all)
set -euo pipefail
# shellcheck source=scripts/system.sh
source "${BASH_SOURCE[0]%/*}/../scripts/system.sh"

declare -A PACKAGE=([redis]=redis-server [nats]=nats-server [rabbitmq]=rabbitmq-server
                    [beanstalkd]=beanstalkd)
declare -A BINARY=([redis]=redis-server [nats]=nats-server [rabbitmq]=rabbitmq-server
                   [beanstalkd]=beanstalkd)

brokers=("$@")
[[ ${#brokers[@]} -eq 0 ]] && brokers=(redis nats rabbitmq beanstalkd)

missing=()
for broker in "${brokers[@]}"; do
  [[ "$broker" == fila ]] && continue  # Fila comes from this repository's .venv
  pkg="${PACKAGE[$broker]:-}"
  if [[ -z "$pkg" ]]; then
    echo "install.sh: unknown broker '$broker' (redis, nats, rabbitmq, beanstalkd)" >&2
    exit 2
  fi
  # rabbitmq-server lives in /usr/sbin, which a non-login PATH may lack
  if ! command -v "${BINARY[$broker]}" >/dev/null && [[ ! -x "/usr/sbin/${BINARY[$broker]}" ]]; then
    missing+=("$pkg")
  fi
done
# taskset pins broker and load generator to separate CPUs (util-linux, normally present)
command -v taskset >/dev/null || missing+=(util-linux)

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install.sh: everything present"
  exit 0
fi

echo "install.sh: apt-get install ${missing[*]}"
# policy-rc.d = 101 keeps the packages' postinst from starting system-wide services
# (a Redis on 6379 or a RabbitMQ node would otherwise run beside the benchmark).
# (FILA_POLICY_RC_D moves it, for tests/test_bench_competitive.py only.)
policy=${FILA_POLICY_RC_D:-/usr/sbin/policy-rc.d}
created_policy=0
if [[ ! -e "$policy" ]]; then
  if [[ ${#AS_ROOT[@]} -eq 0 ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy"
  else
    printf '#!/bin/sh\nexit 101\n' | sudo_if_needed tee "$policy" >/dev/null
  fi
  sudo_if_needed chmod +x "$policy"
  created_policy=1
fi
# An `if`, not `[[ ]] && rm`: the trap's last status becomes the script's, and a
# machine that already had policy-rc.d (a Docker image) made a good install exit 1.
cleanup() { if [[ $created_policy -eq 1 ]]; then sudo_if_needed rm -f "$policy"; fi; }
trap cleanup EXIT
apt_install --no-install-recommends "${missing[@]}"
