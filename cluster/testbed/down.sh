#!/usr/bin/env bash
# Tear down what cluster/testbed/up.sh started, and only that.
# Idempotent: running it on a machine without a testbed does nothing.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"

[[ $(id -u) -eq 0 ]] || die "must run as root"

if [[ ! -d $TESTBED_DIR ]] && ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    log "nothing to tear down"
    exit 0
fi

# Jobs first, so their steps (and the Ray processes in them) get signalled
# by Slurm the normal way while the daemons are still there.
if pidfile_alive "$TESTBED_DIR/slurmctld.pid"; then
    jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ' || true)
    if [[ -n ${jobs// /} ]]; then
        log "cancelling remaining jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        for ((i = 0; i < 200; i++)); do
            [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.2
        done
    fi
fi

# slurmd before slurmctld; each one from the pid file the testbed wrote.
shopt -s nullglob
for pf in "$TESTBED_DIR"/run/slurmd-*.pid; do
    name=${pf##*/slurmd-}
    stop_pidfile "$pf" "slurmd ${name%.pid}"
done
# Anything still living in a node's network namespace was started by the
# testbed (slurmstepd, job processes): TERM, then KILL.
ours=()
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NETNS_PREFIX}[0-9]+$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null || true); do
        pid_alive "$pid" && ours+=("$pid")
    done
done
if ((${#ours[@]})); then
    log "stopping ${#ours[@]} leftover process(es) in the node namespaces: ${ours[*]}"
    kill -TERM "${ours[@]}" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        left=()
        for pid in "${ours[@]}"; do pid_alive "$pid" && left+=("$pid"); done
        ((${#left[@]} == 0)) && break
        sleep 0.1
    done
    ((${#left[@]})) && kill -KILL "${left[@]}" 2>/dev/null || true
fi
stop_pidfile "$TESTBED_DIR/slurmctld.pid" slurmctld
stop_pidfile "$TESTBED_DIR/run/munged.pid" munged   # only if up.sh started it

# Namespaces and links (deleting a namespace removes its end of the veth).
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NETNS_PREFIX}[0-9]+$" || true); do
    log "deleting namespace $ns"
    ip netns delete "$ns" || true
done
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^${VETH_PREFIX}[0-9]+$" || true); do
    ip link delete "$link" 2>/dev/null || true
done
if ip link show "$BRIDGE" >/dev/null 2>&1; then
    log "deleting bridge $BRIDGE"
    ip link delete "$BRIDGE"
fi

for conf in "$SLURM_CONF" "$GRES_CONF"; do
    if [[ -f $conf ]] && grep -qF "$CONF_MARKER" "$conf"; then
        log "removing $conf"
        rm -f "$conf"
    fi
done
log "removing $TESTBED_DIR"
rm -rf "$TESTBED_DIR"
log "down"
