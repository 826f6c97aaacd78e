# shellcheck shell=bash
# Sourced by every script that changes the system (Debian packages, services, files
# outside the repository). Runs those steps as root: directly when the script already
# runs as root (this project's CI machine, a Debian container), else through
# passwordless sudo (GitHub's runners, a developer's machine). One place, so no
# script calls apt-get bare and fails for a user who is not root.
#   sudo_if_needed CMD...     run CMD as root
#   apt_install PACKAGE...    install Debian packages (lists updated first)

if [[ "$(id -u)" -eq 0 ]]; then
  AS_ROOT=()
else
  AS_ROOT=(sudo -n)
fi

sudo_if_needed() {
  if [[ ${#AS_ROOT[@]} -gt 0 ]] && ! command -v sudo >/dev/null; then
    echo "needs root for: $*; run as root or install sudo (passwordless) for $(id -un)" >&2
    return 1
  fi
  "${AS_ROOT[@]}" "$@"
}

apt_install() {
  sudo_if_needed apt-get update -qq
  if [[ ${#AS_ROOT[@]} -eq 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
  else
    sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
  fi
}
