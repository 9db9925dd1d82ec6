#!/usr/bin/env bash
# Install what the local Slurm testbed needs (Debian/Ubuntu, as root).
# Idempotent: apt-get only installs what is missing.
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
    echo "install.sh: must run as root (apt-get, daemons, network namespaces)" >&2
    exit 1
fi

# slurm-wlm: slurmctld + slurmd + client tools; munge: Slurm's authentication;
# iproute2: ip netns/bridge/veth; util-linux: nsenter/unshare/flock;
# procps: ps/pgrep for checks; python3 is used by tests only through the venv.
pkgs=(slurm-wlm munge iproute2 util-linux procps)

missing=()
for p in "${pkgs[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$p")
    fi
done

if ((${#missing[@]} == 0)); then
    echo "install.sh: all present: ${pkgs[*]}"
else
    echo "install.sh: installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The Debian packages try to start daemons through systemd; on a machine
# without systemd nothing runs, which is what we want: up.sh starts them.
for b in slurmctld slurmd munged sbatch srun scontrol nsenter unshare ip; do
    command -v "$b" >/dev/null || { echo "install.sh: $b not found after install" >&2; exit 1; }
done
echo "install.sh: ok ($(slurmctld -V))"
