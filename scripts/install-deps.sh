#!/usr/bin/env bash
# System packages the test suite needs on a Debian/Ubuntu control node (CI included).
# Idempotent: apt-get install skips what is already there.
#   debootstrap, systemd-container : build and boot the SSH test hosts (tests/lab/testhosts.py)
#   iproute2                       : network namespaces, veth pairs and the lab bridge
#   openssh-client                 : Ansible, testinfra and fabric reach the test hosts over real SSH
#   rsync                          : the shipping role, the shipper, ansible.posix.synchronize
#   openssh-server                 : the shipper's tests run a private sshd on 127.0.0.1
#   python3-venv                   : scripts/install.sh puts the Python packages into a venv (.venv):
#                                    Debian 12 and Ubuntu 24.04 refuse pip installs into their own Python
set -euo pipefail

packages=(debootstrap systemd-container rsync openssh-client openssh-server iproute2 ca-certificates python3-venv)

if [ "$(id -u)" -ne 0 ]; then
    echo "install-deps.sh: run as root (it installs packages with apt)" >&2
    exit 1
fi

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ "${#missing[@]}" -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    echo "install-deps.sh: all of ${packages[*]} already installed"
fi
