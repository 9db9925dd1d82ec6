#!/usr/bin/env bash
# Bring up a real Slurm cluster of N nodes on this one Linux host (as root).
#
#   cluster/testbed/up.sh [N]      (default N=2)
#
# Each node is a network namespace with its own address on a private bridge,
# its own hostname and /etc/hosts (mount+UTS namespace), and its own slurmd.
# slurmctld and munged run on the host. All nodes share the host filesystem,
# which plays the role of the cluster's shared storage.
# Idempotent: if the same cluster is already up it only checks it.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
source "$HERE/common.sh"

N=${1:-2}
[[ $N =~ ^[1-9][0-9]?$ && $N -le 50 ]] || die "usage: up.sh [N]  (1 <= N <= 50)"
[[ $(id -u) -eq 0 ]] || die "must run as root"
for b in slurmctld slurmd munged scontrol sinfo nsenter unshare ip; do
    command -v "$b" >/dev/null || die "$b not found; run cluster/testbed/install.sh"
done
# One up.sh at a time: a second one would find the first's half-made testbed "broken" and tear it down.
# The daemons started below get the lock's descriptor closed ({up_lock}>&-): one that kept it (munged
# does) would hold the lock for its whole life, and the next up.sh would wait for ever.
exec {up_lock}>/run/raytrain-testbed-up.lock
flock "$up_lock"

# ---- already up? -----------------------------------------------------------
cluster_healthy() {
    [[ -f $TESTBED_DIR/nodes.count && $(cat "$TESTBED_DIR/nodes.count") == "$1" ]] || return 1
    pidfile_alive "$TESTBED_DIR/slurmctld.pid" || return 1
    local i
    for ((i = 1; i <= $1; i++)); do
        pidfile_alive "$TESTBED_DIR/run/slurmd-$(node_name "$i").pid" || return 1
    done
    # every node idle/mixed/allocated (not down/drained)
    ! sinfo -h -N -o '%T' 2>/dev/null | grep -Eqv '^(idle|mixed|allocated|completing)$'
}

if cluster_healthy "$N"; then
    log "already up with $N nodes:"
    sinfo -N -p debug -o '%N %T %c %C' | sed 's/^/[testbed]   /'
    exit 0
fi
if [[ -f $TESTBED_DIR/nodes.count ]]; then
    log "a previous (different or broken) testbed exists; tearing it down first"
    "$HERE/down.sh"
fi

for conf in "$SLURM_CONF" "$GRES_CONF"; do
    if [[ -f $conf ]] && ! grep -qF "$CONF_MARKER" "$conf"; then
        die "$conf exists and was not written by the testbed; refusing to overwrite it"
    fi
done
for pid in $(pgrep -x slurmctld; pgrep -x slurmd); do
    # zombies of stopped daemons do not count (they linger on some hosts)
    pid_alive "$pid" && die "a slurmctld/slurmd not started by the testbed is running (pid $pid); stop it first"
done

mkdir -p "$TESTBED_DIR"/{run,log,state,spool,nodes,shared}   # shared/: the cluster's "shared storage"
echo "$N" >"$TESTBED_DIR/nodes.count"

# ---- munge (Slurm's authentication; one daemon serves all nodes, because
# the namespaces share the filesystem and thus the unix socket) -------------
munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if munge_ok; then
    log "munged already running; using it"
else
    log "starting munged"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        install -d -o munge -g munge -m 0700 /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    runuser -u munge -- munged {up_lock}>&-
    for ((i = 0; i < 50; i++)); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munged did not come up (see /var/log/munge/munged.log)"
    cp /run/munge/munged.pid "$TESTBED_DIR/run/munged.pid"   # ours: down.sh stops it
fi

# ---- network: bridge on the host, one namespace + veth per node -----------
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    log "creating bridge $BRIDGE $HOST_ADDR/24"
    ip link add "$BRIDGE" type bridge
    ip addr add "$HOST_ADDR/24" dev "$BRIDGE"
fi
ip link set "$BRIDGE" up
# Never route testbed packets anywhere else, even if the host forwards.
sysctl -qw "net.ipv4.conf.$BRIDGE.forwarding=0" || true
sysctl -qw "net.ipv6.conf.$BRIDGE.disable_ipv6=1" 2>/dev/null || true

hosts_file="$TESTBED_DIR/hosts"
{
    echo "127.0.0.1 localhost"
    echo "$HOST_ADDR $CTLD_HOST"
    for ((i = 1; i <= N; i++)); do echo "$(node_addr "$i") $(node_name "$i")"; done
} >"$hosts_file"
# Fail fast: nothing listens on port 53 of a node's loopback, so lookups of
# unknown names fail at once instead of stalling 10 s on an unreachable DNS.
printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' >"$TESTBED_DIR/resolv.conf"

for ((i = 1; i <= N; i++)); do
    ns="${NETNS_PREFIX}$i" veth="${VETH_PREFIX}$i" addr=$(node_addr "$i")
    if ! ip netns list | grep -qw "$ns"; then
        log "creating namespace $ns ($(node_name "$i") = $addr)"
        ip netns add "$ns"
    fi
    if ! ip link show "$veth" >/dev/null 2>&1; then
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        ip link set "$veth" master "$BRIDGE"
        ip link set "$veth" up
    fi
    nsx=(nsenter --net="/run/netns/$ns")
    "${nsx[@]}" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 2>/dev/null || true
    "${nsx[@]}" ip link set lo up
    "${nsx[@]}" ip link set eth0 up
    "${nsx[@]}" ip addr replace "$addr/24" dev eth0
    # Ray picks its node IP from the route to the outside: give it one.
    "${nsx[@]}" ip route replace default via "$HOST_ADDR" dev eth0
done

# ---- fake GPUs: Slurm GRES needs device files; NVIDIA's major number, never opened ----
# (a gres.conf line without File= is dropped by slurmd and the node set INVAL)
mkdir -p "$TESTBED_DIR/dev" "$(dirname "$GRES_CONF")"
for ((g = 0; g < FAKE_GPUS; g++)); do
    [[ -e $TESTBED_DIR/dev/nvidia$g ]] || mknod "$TESTBED_DIR/dev/nvidia$g" c 195 "$g"
done
{
    echo "$CONF_MARKER"
    echo "AutoDetect=off"
    for ((i = 1; i <= N; i++)); do
        echo "NodeName=$(node_name "$i") Name=gpu File=$TESTBED_DIR/dev/nvidia[0-$((FAKE_GPUS - 1))]"
    done
} >"$GRES_CONF"

# ---- slurm.conf ------------------------------------------------------------
log "writing $SLURM_CONF"
mkdir -p "$(dirname "$SLURM_CONF")"
{
    echo "$CONF_MARKER"
    cat <<CONF
ClusterName=raytrain-testbed
SlurmctldHost=${CTLD_HOST}(${HOST_ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# No cgroups or systemd here: track processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
StateSaveLocation=${TESTBED_DIR}/state
SlurmctldPidFile=${TESTBED_DIR}/slurmctld.pid
SlurmctldLogFile=${TESTBED_DIR}/log/slurmctld.log
SlurmdSpoolDir=${TESTBED_DIR}/spool/%n
SlurmdPidFile=${TESTBED_DIR}/run/slurmd-%n.pid
SlurmdLogFile=${TESTBED_DIR}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ReturnToService=2
# Finished jobs leave squeue after 5 s (default 300 makes sbatch --wait late).
MinJobAge=5
# A requeued job waits cred_expire seconds before it may start again (default
# 120, at least 5), then for the next scheduling pass (backfill every 30 s by
# default), as does a job submitted while the last job's nodes still complete
# (each test's job, right after the one before): 5 and 1 keep the tests short.
AuthInfo=cred_expire=5
SchedulerParameters=bf_interval=1
KillWait=30
InactiveLimit=0
SlurmdTimeout=60
# Preemption as sites run it: a job of a higher partition tier requeues a "debug" job, which first gets
# its --signal (B:USR1) and GraceTime to checkpoint, TERM after that.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
# 3 CPUs per node whatever the host has (config_overrides: trust this file,
# not the hardware): a 1-worker-per-node Ray job needs a worker's CPUs plus
# one whole CPU for data loading on each node.
SlurmdParameters=config_overrides
# GPUs that CUDA never sees (see gres.conf): a --use-gpu job gets as far as the CUDA probe.
GresTypes=gpu
NodeName=DEFAULT CPUs=3 RealMemory=4000 Gres=gpu:${FAKE_GPUS} State=UNKNOWN
CONF
    for ((i = 1; i <= N; i++)); do
        echo "NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i")"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1 GraceTime=90"
    echo "PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=2 PreemptMode=OFF"
} >"$SLURM_CONF"

# ---- slurmctld on the host -------------------------------------------------
if ! pidfile_alive "$TESTBED_DIR/slurmctld.pid"; then
    log "starting slurmctld on $CTLD_HOST ($HOST_ADDR)"
    # -c: start clean (no saved jobs/node states from an earlier testbed)
    slurmctld -c {up_lock}>&-
fi

# ---- one slurmd per node, inside its namespace -----------------------------
for ((i = 1; i <= N; i++)); do
    name=$(node_name "$i")
    pf="$TESTBED_DIR/run/slurmd-$name.pid"
    pidfile_alive "$pf" && continue
    mkdir -p "$TESTBED_DIR/spool/$name"
    log "starting slurmd $name in namespace ${NETNS_PREFIX}$i"
    # nsenter (not `ip netns exec`, which remounts /sys and hides the cgroup
    # tree slurmd needs); unshare gives the node its own hostname and lets us
    # bind its /etc/hosts and resolv.conf without touching the host's.
    nsenter --net="/run/netns/${NETNS_PREFIX}$i" \
        unshare --mount --uts --propagation private -- /bin/sh -c '
            hostname "$1"
            mount --bind "$2" /etc/hosts
            mount --bind "$3" /etc/resolv.conf
            exec slurmd -N "$1"
        ' sh "$name" "$hosts_file" "$TESTBED_DIR/resolv.conf" {up_lock}>&-
done

# ---- wait until every node is idle ----------------------------------------
log "waiting for $N nodes to become idle"
for ((t = 0; t < 300; t++)); do
    states=$(sinfo -h -N -p debug -o '%N %T' 2>/dev/null || true)
    idle=$(grep -c ' idle$' <<<"$states" || true)
    [[ $idle -eq $N ]] && break
    # nodes that registered while the controller still thought them down
    if grep -Eq ' (down|drained|draining|unknown)' <<<"$states" && ((t % 10 == 9)); then
        scontrol update nodename="$(node_name 1)" state=resume 2>/dev/null || true
        for ((i = 2; i <= N; i++)); do
            scontrol update nodename="$(node_name "$i")" state=resume 2>/dev/null || true
        done
    fi
    sleep 0.1
done
if [[ $idle -ne $N ]]; then
    echo "$states" >&2
    die "nodes did not become idle; logs in $TESTBED_DIR/log"
fi
mkdir -p "$TESTBED_DIR/shared"
log "up: $N nodes, controller $CTLD_HOST ($HOST_ADDR), logs in $TESTBED_DIR/log, shared storage $TESTBED_DIR/shared"
sinfo -N -p debug -o '%N %T %c %C' | sed 's/^/[testbed]   /'
