#!/usr/bin/env bash
# ---------------------------------------------------------------------------
# One Slurm job = one Ray cluster = one training run.
#
#   sbatch [sbatch options] cluster/start_ray_slurm.sh [trainer args...]
#   e.g. sbatch --nodes=2 --gpus-per-node=3 cluster/start_ray_slurm.sh --epochs 10 --data /shared/ds
#
# Starts a Ray head on the first node and one Ray worker per other node (one
# background `srun` step per node), waits until every node has joined, runs
#   python -u -m raytrain_ddp.run --address HEAD_IP:PORT --num-workers N [--use-gpu] <your args>
# on the head node, and stops this job's Ray processes when the job ends,
# however it ends. The job's exit code is the trainer's (0 ok, 1 training
# failed, 2 bad input/infeasible request, 75 stopped early after a checkpoint);
# 3 means the Ray cluster could not be brought up (the log says which node and
# why).
#
# Time limit and preemption: Slurm sends USR1 300 s before the end; the script
# forwards it to the trainer, which checkpoints at the next step and exits 75;
# the script then stops Ray and requeues the job (`scontrol requeue`). The
# requeued job keeps its job id, hence its run name and directory, and resumes
# from that checkpoint. The job log (appended to, not overwritten) shows both.
#
# Edit the defaults below, or override any of them on the sbatch command line.
#SBATCH --job-name=raytrain
#SBATCH --nodes=2                  # machines; one Ray node per machine
#SBATCH --ntasks-per-node=1        # keep 1: the one task per node is the Ray node
#SBATCH --cpus-per-task=8          # CPUs per node for Ray (workers + data loading)
#SBATCH --gpus-per-node=1          # GPUs per node; one training worker per GPU (0 = CPU training)
#SBATCH --time=04:00:00            # wall-clock limit
#SBATCH --output=raytrain-%j.out   # job log (%j = job id), relative to the submit dir
#SBATCH --requeue                  # let Slurm requeue the job after a node failure/preemption
#SBATCH --signal=B:USR1@300        # USR1 to this script 300 s before the time limit -> trainer checkpoints
#SBATCH --open-mode=append         # a requeued job appends to the log instead of overwriting it
#
# Environment knobs (all optional):
#   RAYTRAIN_PYTHON          python to use (default: `python` from PATH, i.e. your activated env)
#   RAYTRAIN_MODULE          trainer module (default: raytrain_ddp.run)
#   RAYTRAIN_HEAD_ADDR       head IP address to use (skips detection)
#   RAYTRAIN_NET_IFACE       network interface whose address Ray nodes use (e.g. ib0)
#   RAYTRAIN_CPUS_PER_NODE / RAYTRAIN_GPUS_PER_NODE   override what Slurm says
#   RAYTRAIN_TMPDIR          base of Ray's per-job temp dir on each node (default /tmp; keep it short)
#   RAYTRAIN_JOB_DIR_BASE    shared, private dir for the job's auth token (default ~/.raytrain)
#   RAYTRAIN_JOIN_TIMEOUT    seconds to wait for all nodes to join (default 180)
#   RAYTRAIN_DASHBOARD       1/0: start the Ray dashboard on the head (default 1)
#   RAY_OBJECT_STORE_MEMORY  object store bytes per node (default: Ray's choice)
#   RAYTRAIN_DRY_RUN=1       print the plan (nodes, resources, ports, command) and exit
# ---------------------------------------------------------------------------
set -euo pipefail

log() { echo "[raytrain $(date +%H:%M:%S)] $*"; }
err() { echo "[raytrain $(date +%H:%M:%S)] ERROR: $*" >&2; }
EXIT_BRINGUP=3

if [[ -z ${SLURM_JOB_ID:-} ]]; then
    err "not inside a Slurm job; submit with: sbatch $0 [trainer args]"
    exit 2
fi

JOB=$SLURM_JOB_ID
PY=${RAYTRAIN_PYTHON:-python}
MODULE=${RAYTRAIN_MODULE:-raytrain_ddp.run}
TMP_BASE=${RAYTRAIN_TMPDIR:-/tmp}
JOIN_TIMEOUT=${RAYTRAIN_JOIN_TIMEOUT:-180}
HEAD_TIMEOUT=${RAYTRAIN_HEAD_TIMEOUT:-120}
export RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}   # compute nodes rarely reach the internet

# ===========================================================================
# Functions that also run on the other nodes (shipped to each srun step with
# `declare -f`, because Slurm runs a *copy* of this script from its spool dir
# on the first node only).
# ===========================================================================

# Is this pid a live process? (zombies of stopped Ray processes do not count)
rt_alive() {
    local st
    st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
    [[ -n $st && $st != Z && $st != X ]]
}

# Pids of processes carrying RAYTRAIN_RAY_TAG=<value starting with $1> in
# their environment. Every Ray process of a node inherits that variable from
# the `ray start` we launch, including workers whose parent died, so this
# finds exactly this job's Ray processes and nothing else.
rt_tagged_pids() {
    local prefix=$1 p pid
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [[ $pid == "$$" || $pid == "${BASHPID:-}" ]] && continue
        if tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -q "^RAYTRAIN_RAY_TAG=${prefix}"; then
            rt_alive "$pid" && echo "$pid"
        fi
    done
    return 0
}

# Stop the processes tagged with $1 (TERM, grace period, KILL); remove dir $2.
rt_sweep() {
    local prefix=$1 dir=${2:-} pids i
    pids=$(rt_tagged_pids "$prefix")
    if [[ -n $pids ]]; then
        # shellcheck disable=SC2086
        kill -TERM $pids 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do
            pids=$(rt_tagged_pids "$prefix")
            [[ -z $pids ]] && break
            sleep 0.2
        done
        if [[ -n $pids ]]; then
            echo "[raytrain $(hostname -s)] killing Ray processes that ignored TERM: $(echo $pids)"
            # shellcheck disable=SC2086
            kill -KILL $pids 2>/dev/null || true
        fi
    fi
    [[ -n $dir && -d $dir ]] && rm -rf -- "$dir"
    return 0
}

# Number of GPUs in a Slurm spec like "3", "a100:3", "gpu:a100:3", "gres/gpu:3",
# or "gres/gpu:a100:2,gres/shard:1" (0 when there is no GPU part).
rt_gpu_count() {
    local spec=${1:-} item
    [[ -z $spec ]] && { echo 0; return; }
    IFS=, read -ra items <<<"$spec"
    for item in "${items[@]}"; do
        item=${item#gres/}; item=${item#gres:}
        if [[ $item =~ ^[0-9]+$ ]]; then echo "$item"; return; fi
        if [[ $item =~ ^gpu(:[^:]+)?:([0-9]+) ]]; then echo "${BASH_REMATCH[2]}"; return; fi
        if [[ $item != gpu* && $item =~ ^[^:]+:([0-9]+)$ ]]; then echo "${BASH_REMATCH[1]}"; return; fi
    done
    echo 0
}

# GPUs on this node according to Slurm ($1 = fallback estimate).
rt_node_gpus() {
    if [[ -n ${RAYTRAIN_GPUS_PER_NODE:-} ]]; then echo "$RAYTRAIN_GPUS_PER_NODE"; return; fi
    if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then echo "$SLURM_GPUS_ON_NODE"; return; fi
    local ids=${SLURM_STEP_GPUS:-${SLURM_JOB_GPUS:-}}
    if [[ -n $ids ]]; then awk -F, '{print NF}' <<<"$ids"; return; fi
    echo "${1:-0}"
}

# An IPv4 (else IPv6) address of this node: the override interface if given,
# else the source address of the route towards $1 (the head; a route lookup,
# no packet is sent), else the hostname's non-loopback address if it is
# configured here, else the first global address.
rt_node_ip() {
    local towards=${1:-} a
    if [[ -n ${RAYTRAIN_NET_IFACE:-} ]]; then
        a=$(ip -o -4 addr show dev "$RAYTRAIN_NET_IFACE" scope global 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -1)
        [[ -z $a ]] && a=$(ip -o -6 addr show dev "$RAYTRAIN_NET_IFACE" scope global 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -1)
        if [[ -z $a ]]; then
            echo "[raytrain $(hostname -s)] ERROR: RAYTRAIN_NET_IFACE=$RAYTRAIN_NET_IFACE has no global address on $(hostname -s)" >&2
            return 1
        fi
        echo "$a"; return 0
    fi
    local mine
    mine=$(ip -o addr show scope global 2>/dev/null | awk '{print $4}' | cut -d/ -f1)
    if [[ -n $towards ]]; then
        a=$(ip route get "$towards" 2>/dev/null | sed -n 's/.* src \([^ ]*\).*/\1/p' | head -1)
        if [[ -n $a ]] && grep -qxF "$a" <<<"$mine"; then echo "$a"; return 0; fi
    fi
    for a in $(getent ahostsv4 "$(hostname)" 2>/dev/null | awk '{print $1}' | sort -u) \
             $(getent ahostsv6 "$(hostname)" 2>/dev/null | awk '{print $1}' | sort -u); do
        [[ $a == 127.* || $a == ::1 || $a == ::ffff:127.* ]] && continue
        grep -qxF "$a" <<<"$mine" && { echo "$a"; return 0; }
    done
    a=$(ip -o -4 addr show scope global 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -1)
    [[ -z $a ]] && a=$(ip -o -6 addr show scope global 2>/dev/null | awk '{print $4}' | cut -d/ -f1 | head -1)
    [[ -n $a ]] && { echo "$a"; return 0; }
    echo "[raytrain $(hostname -s)] ERROR: no usable IP address on $(hostname -s); set RAYTRAIN_NET_IFACE or RAYTRAIN_HEAD_ADDR" >&2
    return 1
}

# host:port, bracketing IPv6 addresses.
rt_hostport() { if [[ $1 == *:* ]]; then echo "[$1]:$2"; else echo "$1:$2"; fi; }

# Print the ports among "$@" that cannot be bound here (in use).
rt_busy_ports() {
    "$RT_PY" - "$@" <<'PYEOF'
import socket, sys
for p in map(int, sys.argv[1:]):
    for fam, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        s = socket.socket(fam, socket.SOCK_STREAM)
        try:
            s.bind((addr, p))
        except OSError as e:
            if fam == socket.AF_INET or e.errno == 98:  # no IPv6 stack: ignore
                print(p)
                break
        finally:
            s.close()
PYEOF
}

# A free port chosen by the kernel (for node-local ports that must not collide).
rt_free_port() {
    "$RT_PY" -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'
}

# Body of each per-node srun step: start this node's Ray (head or worker)
# with --block, and on TERM/INT/exit stop exactly this node's Ray processes
# and remove its temp dir.
rt_node_main() {
    set -uo pipefail
    local host ip agent_port gpus rc
    host=$(hostname -s)
    # tmp and tag stay global: the EXIT trap needs them after this returns
    tmp="$RT_TMP_BASE/rt${RT_JOB}.${RT_NODE_INDEX}"   # short: Ray's socket paths must fit in 107 bytes
    tag="rt-${RT_JOB}-${RT_NODE_INDEX}"
    trap 'rt_sweep "$tag" "$tmp"' EXIT
    trap 'exit 143' TERM
    trap 'exit 130' INT
    rm -rf -- "$tmp"                                   # stale, e.g. after a requeue
    # shellcheck disable=SC2174  # the parents exist (TMPDIR); only $tmp itself is ours
    mkdir -p -m 0700 "$tmp"

    if [[ ! -r $RAY_AUTH_TOKEN_PATH ]]; then
        echo "[raytrain $host] ERROR: auth token $RAY_AUTH_TOKEN_PATH is not readable on $host;" \
             "put RAYTRAIN_JOB_DIR_BASE on storage all nodes share" >&2
        exit 1
    fi
    if [[ $RT_ROLE == head ]]; then
        ip=$RT_HEAD_IP
    else
        ip=$(rt_node_ip "$RT_HEAD_IP") || exit 1
    fi
    # The dashboard agent's HTTP port defaults to a fixed 52365: take the
    # job's derived port if free on this node, else any free port.
    agent_port=$RT_AGENT_PORT
    if [[ -n $(rt_busy_ports "$agent_port") ]]; then
        agent_port=$(rt_free_port)
        echo "[raytrain $host] port $RT_AGENT_PORT busy here; dashboard agent uses $agent_port"
    fi
    gpus=$(rt_node_gpus "$RT_GPUS_ESTIMATE")
    echo "$RT_NODE_NAME $host $ip" >"$RT_JOB_DIR/node.$RT_NODE_INDEX"

    local args=(start --block --disable-usage-stats --log-style=record --log-color=false
        --node-ip-address="$ip" --temp-dir="$tmp"
        --num-cpus="$RT_NODE_CPUS" --num-gpus="$gpus"
        --dashboard-agent-listen-port="$agent_port")
    [[ -n ${RAY_OBJECT_STORE_MEMORY:-} ]] && args+=(--object-store-memory="$RAY_OBJECT_STORE_MEMORY")
    if [[ $RT_ROLE == head ]]; then
        args+=(--head --port="$RT_GCS_PORT" --ray-client-server-port="$RT_CLIENT_PORT")
        if [[ $RT_DASHBOARD == 1 ]]; then
            args+=(--include-dashboard=true --dashboard-host="$ip" --dashboard-port="$RT_DASH_PORT")
        else
            args+=(--include-dashboard=false)
        fi
    else
        args+=(--address="$RT_HEAD_ADDRESS")
    fi
    echo "[raytrain $host] ray start ($RT_ROLE) ip=$ip cpus=$RT_NODE_CPUS gpus=$gpus temp-dir=$tmp"
    # The tag goes only into Ray's environment (not this shell's), so the
    # sweep finds Ray's processes and never this wrapper.
    RAYTRAIN_RAY_TAG=$tag "$RT_PY" -m ray.scripts.scripts "${args[@]}" &
    local raypid=$!
    # Run until Ray dies or the batch script asks us to stop (a file on the
    # shared job dir: a clean exit, where signalling the step would make
    # Slurm report it as cancelled and SIGKILL it).
    while rt_alive "$raypid"; do
        if [[ -e $RT_JOB_DIR/stop ]]; then
            echo "[raytrain $host] stopping Ray ($RT_ROLE)"
            rt_sweep "$tag" "$tmp"
            wait "$raypid" 2>/dev/null
            exit 0
        fi
        sleep 1
    done
    wait "$raypid"
    rc=$?
    echo "[raytrain $host] ray ($RT_ROLE) exited with code $rc"
    exit "$rc"
}

# ===========================================================================
# Batch part: runs on the first node of the allocation.
# ===========================================================================

# ---- forwarded trainer arguments: see what the user already chose ---------
ARGS=("$@")
CONFIG_KV=""   # key=value lines of a --config TOML file: settings the user chose there
has_flag() {   # has_flag --name  -> true if --name / --name=... is among ARGS or in --config
    local a key=${1#--}
    for a in "${ARGS[@]+"${ARGS[@]}"}"; do
        [[ $a == "$1" || $a == "$1="* ]] && return 0
    done
    key=${key//-/_}
    [[ -n $CONFIG_KV ]] && grep -q "^${key}=" <<<"$CONFIG_KV"
}
flag_value() {  # value of --name X / --name=X (last one wins; flags beat --config)
    local i v="" key=${1#--}
    key=${key//-/_}
    [[ -n $CONFIG_KV ]] && v=$(sed -n "s/^${key}=//p" <<<"$CONFIG_KV" | tail -1)
    for ((i = 0; i < ${#ARGS[@]}; i++)); do
        case ${ARGS[i]} in
            "$1") v=${ARGS[i + 1]:-} ;;
            "$1="*) v=${ARGS[i]#*=} ;;
        esac
    done
    echo "$v"
}
if has_flag --address; then
    err "do not pass --address: the script points the trainer at this job's Ray cluster"
    exit 2
fi

if ! command -v "$PY" >/dev/null; then
    err "python '$PY' not found on $(hostname -s); activate your environment before sbatch or set RAYTRAIN_PYTHON"
    exit 2
fi
PY=$(command -v "$PY")
if ! ray_version=$("$PY" -c 'import ray; print(ray.__version__)' 2>/dev/null); then
    err "'$PY' cannot import ray; install the project into that environment"
    exit 2
fi
CONFIG_FILE=$(flag_value --config)
if [[ -n $CONFIG_FILE ]]; then
    # A setting in the trainer's --config file counts as the user's choice.
    CONFIG_KV=$("$PY" -c 'import sys, tomllib
for k, v in tomllib.load(open(sys.argv[1], "rb")).items():
    print(f"{k}={str(v).lower() if isinstance(v, bool) else v}")' "$CONFIG_FILE" 2>/dev/null) || CONFIG_KV=""
fi

# ---- nodes, head and its address --------------------------------------------
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
NNODES=${#NODES[@]}
HEAD=${NODES[0]}
if [[ -n ${RAYTRAIN_HEAD_ADDR:-} ]]; then
    HEAD_IP=$RAYTRAIN_HEAD_ADDR
else
    HEAD_IP=$(rt_node_ip "") || exit "$EXIT_BRINGUP"
fi
# Prefer an address that reaches the other nodes: if a worker node resolves,
# ask the route table for the source address towards it.
if [[ -z ${RAYTRAIN_HEAD_ADDR:-} && -z ${RAYTRAIN_NET_IFACE:-} && $NNODES -gt 1 ]]; then
    peer=$(getent ahostsv4 "${NODES[1]}" 2>/dev/null | awk '{print $1; exit}')
    if [[ -n $peer && $peer != 127.* ]]; then
        HEAD_IP=$(rt_node_ip "$peer") || exit "$EXIT_BRINGUP"
    fi
fi

# ---- per-job ports: derived from the job id, checked free -------------------
# Block of 4 ports: GCS, dashboard, Ray client server, dashboard agent (HTTP).
# 20000-29999 sits between Ray's worker ports (10002-19999) and the kernel's
# ephemeral range (32768+). Other Ray ports are picked at random by Ray.
RT_PY=$PY
DERIVED_BASE=$((20000 + (JOB % 1000) * 10))
PORT_BASE=""
for ((k = 0; k < 100; k++)); do
    cand=$((20000 + ((JOB + k) % 1000) * 10))
    busy=$(rt_busy_ports "$cand" $((cand + 1)) $((cand + 2)) $((cand + 3)))
    if [[ -z $busy ]]; then PORT_BASE=$cand; break; fi
    log "ports busy on $HEAD: $(echo $busy) (block $cand); trying the next block"
done
if [[ -z $PORT_BASE ]]; then
    err "no free port block in 20000-29999 on $HEAD"
    exit "$EXIT_BRINGUP"
fi
if [[ $PORT_BASE != "$DERIVED_BASE" ]]; then
    log "derived port block $DERIVED_BASE was busy; using port block $PORT_BASE"
fi
GCS_PORT=$PORT_BASE DASH_PORT=$((PORT_BASE + 1)) CLIENT_PORT=$((PORT_BASE + 2)) AGENT_PORT=$((PORT_BASE + 3))
HEAD_ADDRESS=$(rt_hostport "$HEAD_IP" "$GCS_PORT")

# ---- resources per node -------------------------------------------------------
# CPUs per node, one entry per node (SLURM_JOB_CPUS_PER_NODE is e.g. "8(x2),4").
CPUS=()
if [[ -n ${RAYTRAIN_CPUS_PER_NODE:-} ]]; then
    for ((i = 0; i < NNODES; i++)); do CPUS+=("$RAYTRAIN_CPUS_PER_NODE"); done
elif [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    for ((i = 0; i < NNODES; i++)); do CPUS+=("$SLURM_CPUS_PER_TASK"); done
elif [[ -n ${SLURM_JOB_CPUS_PER_NODE:-} ]]; then
    IFS=, read -ra parts <<<"$SLURM_JOB_CPUS_PER_NODE"
    for p in "${parts[@]}"; do
        if [[ $p =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
            for ((i = 0; i < BASH_REMATCH[2]; i++)); do CPUS+=("${BASH_REMATCH[1]}"); done
        else
            CPUS+=("$p")
        fi
    done
fi
while ((${#CPUS[@]} < NNODES)); do CPUS+=("${SLURM_CPUS_ON_NODE:-$(nproc)}"); done
MIN_CPUS=$(printf '%s\n' "${CPUS[@]}" | sort -n | head -1)

# GPUs per node as Slurm describes the job (each node re-checks its own).
if [[ -n ${RAYTRAIN_GPUS_PER_NODE:-} ]]; then
    GPUS_EST=$RAYTRAIN_GPUS_PER_NODE
elif [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
    GPUS_EST=$SLURM_GPUS_ON_NODE
elif [[ -n ${SLURM_JOB_GPUS:-} ]]; then
    GPUS_EST=$(awk -F, '{print NF}' <<<"$SLURM_JOB_GPUS")
elif [[ -n ${SLURM_GPUS_PER_NODE:-} ]]; then
    GPUS_EST=$(rt_gpu_count "$SLURM_GPUS_PER_NODE")
elif [[ -n ${SLURM_TRES_PER_NODE:-} || -n ${SLURM_GRES:-} ]]; then
    GPUS_EST=$(rt_gpu_count "${SLURM_TRES_PER_NODE:-$SLURM_GRES}")
elif [[ -n ${SLURM_GPUS:-} ]]; then
    GPUS_EST=$(( $(rt_gpu_count "$SLURM_GPUS") / NNODES ))
else
    GPUS_EST=0
fi

# ---- can the allocation hold the requested workers at all? -------------------------
# Answer in a second instead of after Ray's start-up (the trainer checks again
# against the live cluster). Only where Slurm states the numbers per node.
if has_flag --num-workers && [[ ${RAYTRAIN_PRECHECK:-1} == 1 ]]; then
    want=$(flag_value --num-workers)
    if [[ ! $want =~ ^[1-9][0-9]*$ ]]; then
        err "--num-workers must be a positive integer, got '$want'"
        exit 2
    fi
    if ((GPUS_EST > 0)) && [[ -n ${RAYTRAIN_GPUS_PER_NODE:-}${SLURM_GPUS_PER_NODE:-} ]]; then
        if ((want > GPUS_EST * NNODES)); then
            err "asked for $want GPU workers, but this job has $NNODES node(s) x $GPUS_EST GPU(s) = $((GPUS_EST * NNODES)) GPU(s)"
            exit 2
        fi
    elif ((GPUS_EST == 0)); then
        cpw=$(flag_value --cpus-per-worker)
        [[ $cpw =~ ^[0-9]+$ && $cpw -gt 0 ]] || cpw=1
        slots=0
        for c in "${CPUS[@]}"; do slots=$((slots + c / cpw)); done
        if ((want > slots)); then
            err "asked for $want CPU workers ($cpw CPU(s) each), but this job has $NNODES node(s) with CPUs ${CPUS[*]}: room for $slots worker(s)"
            exit 2
        fi
    fi
fi

# ---- run directory on shared storage ---------------------------------------------
if has_flag --storage-path; then
    STORAGE=$(flag_value --storage-path)
else
    STORAGE="${SLURM_SUBMIT_DIR:-$PWD}/runs"
    ARGS+=(--storage-path "$STORAGE")
fi
if has_flag --name; then
    NAME=$(flag_value --name)
else
    jobname=${SLURM_JOB_NAME:-raytrain}
    jobname=${jobname//[^A-Za-z0-9._-]/_}
    NAME="${jobname#[._-]}-$JOB"
    ARGS+=(--name "$NAME")
fi
if ((NNODES > 1)); then
    fstype=$(stat -f -c %T "$STORAGE" 2>/dev/null || stat -f -c %T "$(dirname "$STORAGE")" 2>/dev/null || echo "?")
    if [[ $STORAGE =~ ^/(tmp|var/tmp|dev/shm|local|scratch/local|lscratch|localscratch)(/|$) || $fstype == tmpfs ]]; then
        for _ in 1 2 3; do
            echo "!!!!!! WARNING: --storage-path $STORAGE looks node-local ($fstype), but this job spans $NNODES nodes." >&2
        done
        echo "!!!!!! Checkpoints written by other nodes will not be visible on $HEAD; use shared storage." >&2
    fi
fi

# ---- auth token: one per job, private, on storage all nodes see ------------------
JOB_DIR_BASE=${RAYTRAIN_JOB_DIR_BASE:-$HOME/.raytrain}
JOB_DIR="$JOB_DIR_BASE/job-$JOB"
CTL_DIR="$TMP_BASE/rt${JOB}.ctl"          # head-local bookkeeping
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$JOB_DIR/auth_token"
unset RAY_AUTH_TOKEN                        # it would take precedence over the file

# ---- plan ------------------------------------------------------------------------------
log "job $JOB (restart count ${SLURM_RESTART_COUNT:-0}): $NNODES node(s): ${NODES[*]}; head $HEAD ($HEAD_IP); ray $ray_version; python $PY"
log "per node: cpus ${CPUS[*]}; gpus ~$GPUS_EST (each node re-reads its own allocation)"
log "ports: gcs $GCS_PORT, dashboard $DASH_PORT, client $CLIENT_PORT, agent $AGENT_PORT"
log "run directory: $STORAGE/$NAME"
if [[ ${RAYTRAIN_DRY_RUN:-0} == 1 ]]; then
    log "dry run: would run $PY -u -m $MODULE --address $HEAD_ADDRESS [--num-workers from cluster]$( ((GPUS_EST > 0)) && echo ' --use-gpu') ${ARGS[*]}"
    log "dry run: expected workers $( ((GPUS_EST > 0)) && echo $((GPUS_EST * NNODES)) || echo "$NNODES")"
    exit 0
fi

# ---- cleanup, however the job ends ----------------------------------------------------
STEP_PIDS=()
TRAINER_PID=""
EXIT_CODE=""
CLEANED=0
GOT_USR1=0        # the time-limit warning (or a preemption notice) came
REQUEUE=0         # the trainer stopped after a checkpoint: run this job again
EXIT_STOPPED=75   # the trainer's "stopped early; run the same command again to resume"
cleanup() {
    local rc=${EXIT_CODE:-$?} i pid
    ((CLEANED)) && return 0
    CLEANED=1
    trap '' TERM INT USR1
    if [[ -n $TRAINER_PID ]] && rt_alive "$TRAINER_PID"; then
        log "stopping the trainer (pid $TRAINER_PID)"
        kill -TERM "$TRAINER_PID" 2>/dev/null || true
        for ((i = 0; i < 50; i++)); do rt_alive "$TRAINER_PID" || break; sleep 0.2; done
        rt_alive "$TRAINER_PID" && kill -KILL "$TRAINER_PID" 2>/dev/null
    fi
    if ((${#STEP_PIDS[@]})); then
        log "stopping Ray on ${NNODES} node(s)"
        # Each node's step watches for this file, stops its Ray and exits.
        touch "$JOB_DIR/stop"
        # (Slurm's KillWait, 30 s by default, bounds the whole cleanup on scancel)
        for ((i = 0; i < 75; i++)); do
            local left=0
            for pid in "${STEP_PIDS[@]}"; do rt_alive "$pid" && left=1; done
            ((left)) || break
            sleep 0.2
        done
        # Steps that did not stop (node gone, job being cancelled): srun
        # turns TERM into a cancel of its step, which Slurm enforces.
        for pid in "${STEP_PIDS[@]}"; do rt_alive "$pid" && kill -TERM "$pid" 2>/dev/null; done
        # Belt and braces: sweep every node for this job's tagged processes
        # (fails harmlessly when Slurm is already tearing the job down).
        timeout 60 srun --overlap --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task=1 --mem=0 \
            --export=ALL,RT_JOB="$JOB",RT_TMP_BASE="$TMP_BASE" \
            bash -c "$(declare -f rt_alive rt_tagged_pids rt_sweep)
                     rt_sweep rt-\$RT_JOB- ; rm -rf -- \"\$RT_TMP_BASE\"/rt\$RT_JOB.[0-9]*" \
            >/dev/null 2>&1 || true
    fi
    rt_sweep "rt-$JOB-" ""
    rm -rf -- "$TMP_BASE/rt$JOB".[0-9]* "$CTL_DIR" "$JOB_DIR"
    if [[ -n $(rt_tagged_pids "rt-$JOB-") ]]; then
        err "some Ray processes of job $JOB survived cleanup on $HEAD: $(rt_tagged_pids "rt-$JOB-" | tr '\n' ' ')"
    else
        log "cleanup done: no Ray process of job $JOB left on $HEAD; exit code $rc"
    fi
    # Only now, with Ray stopped on every node: requeueing ends this job at once.
    if ((REQUEUE)); then
        if scontrol requeue "$JOB"; then
            log "requeued job $JOB (restart $((${SLURM_RESTART_COUNT:-0} + 1))): it resumes run $NAME from its checkpoint"
            exit 0   # not a failure: the job runs again
        fi
        err "scontrol requeue $JOB failed; submit the same command again to resume run $NAME"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'log "got TERM (scancel or time limit): shutting down"; EXIT_CODE=143; exit 143' TERM
trap 'log "got INT: shutting down"; EXIT_CODE=130; exit 130' INT

# The pre-timeout warning (sbatch --signal=B:USR1@300): the trainer
# checkpoints at its next step and exits 75; the job is then requeued (in
# cleanup, once Ray is stopped) -- see the end of this script.
on_time_limit_warning() {
    GOT_USR1=1
    if [[ -n $TRAINER_PID ]] && rt_alive "$TRAINER_PID"; then
        log "got USR1 (time limit near): forwarding to the trainer (pid $TRAINER_PID)"
        kill -USR1 "$TRAINER_PID" 2>/dev/null || true
    else
        log "got USR1 (time limit near) before the trainer started; nothing to forward"
    fi
}
trap on_time_limit_warning USR1

# `wait` that survives USR1 (a trapped signal interrupts wait with rc>128).
wait_for() {
    local pid=$1 rc
    while :; do
        rc=0
        wait "$pid" || rc=$?
        if ((rc > 128)) && rt_alive "$pid"; then continue; fi
        return "$rc"
    done
}

umask 077   # token, job dir and control dir are private to the user
rm -rf -- "$JOB_DIR" "$CTL_DIR"
mkdir -p "$JOB_DIR" "$CTL_DIR"
chmod 0700 "$JOB_DIR_BASE" 2>/dev/null || true
"$PY" -c 'import secrets, sys; open(sys.argv[1], "w").write(secrets.token_hex(32))' "$RAY_AUTH_TOKEN_PATH"
chmod 0600 "$RAY_AUTH_TOKEN_PATH"

# ---- start one Ray node per Slurm node ------------------------------------------------
NODE_SCRIPT="$(declare -f rt_alive rt_tagged_pids rt_sweep rt_node_gpus rt_node_ip rt_busy_ports rt_free_port rt_node_main)
rt_node_main"
export RT_JOB=$JOB RT_PY=$PY RT_TMP_BASE=$TMP_BASE RT_JOB_DIR=$JOB_DIR RT_HEAD_IP=$HEAD_IP \
    RT_HEAD_ADDRESS=$HEAD_ADDRESS RT_GCS_PORT=$GCS_PORT RT_DASH_PORT=$DASH_PORT \
    RT_CLIENT_PORT=$CLIENT_PORT RT_AGENT_PORT=$AGENT_PORT RT_GPUS_ESTIMATE=$GPUS_EST \
    RT_DASHBOARD=${RAYTRAIN_DASHBOARD:-1}

start_node() {   # start_node INDEX ROLE
    local i=$1 role=$2 node=${NODES[$1]}
    # --overlap: the cleanup step later shares these nodes; --mem=0: the
    # step gets all of the job's memory on the node.
    RT_NODE_INDEX=$i RT_ROLE=$role RT_NODE_NAME=$node RT_NODE_CPUS=${CPUS[$i]} \
        srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" --cpus-per-task="${CPUS[$i]}" \
        --mem=0 --kill-on-bad-exit=0 --job-name="ray-$role" \
        bash -c "$NODE_SCRIPT" > >(sed -u "s/^/[$node] /") 2>&1 &
    STEP_PIDS+=("$!")
    echo "$!" >"$CTL_DIR/step.$i.pid"
}

log "starting Ray head on $HEAD"
start_node 0 head
for ((t = 0; t < HEAD_TIMEOUT * 2; t++)); do
    "$PY" -c 'import socket,sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1).close()' \
        "$HEAD_IP" "$GCS_PORT" 2>/dev/null && break
    if ! rt_alive "${STEP_PIDS[0]}"; then
        err "Ray head on $HEAD exited during start-up (see the [$HEAD] lines above)"
        EXIT_CODE=$EXIT_BRINGUP; exit "$EXIT_BRINGUP"
    fi
    sleep 0.5
done
if ((t >= HEAD_TIMEOUT * 2)); then
    err "Ray head on $HEAD did not open $HEAD_ADDRESS within ${HEAD_TIMEOUT}s"
    EXIT_CODE=$EXIT_BRINGUP; exit "$EXIT_BRINGUP"
fi
for ((i = 1; i < NNODES; i++)); do
    log "starting Ray worker on ${NODES[$i]}"
    start_node "$i" worker
done

# ---- wait until every node has joined (never silently) --------------------------------
log "waiting up to ${JOIN_TIMEOUT}s for $NNODES node(s) to join $HEAD_ADDRESS"
"$PY" - "$HEAD_ADDRESS" "$NNODES" "$JOIN_TIMEOUT" "$JOB_DIR" "$CTL_DIR" "${NODES[@]}" \
    >"$CTL_DIR/join.out" <<'PYEOF' &
import os, sys, time, logging
address, want, timeout, job_dir, ctl_dir, nodes = (
    sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:])
import ray
deadline = time.time() + timeout

def step_dead():
    """Slurm nodes whose `ray start` step has already exited."""
    dead = []
    for i, n in enumerate(nodes):
        try:
            pid = int(open(f"{ctl_dir}/step.{i}.pid").read())
            st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            if st in "ZX":
                dead.append(n)
        except FileNotFoundError:
            dead.append(n)
        except Exception:
            pass
    return dead

def missing(alive_ips, alive_hosts):
    """[(slurm node, description)] of nodes not (yet) in the Ray cluster."""
    out = []
    for i, n in enumerate(nodes):
        try:
            _, host, ip = open(f"{job_dir}/node.{i}").read().split()
        except Exception:
            out.append((n, f"{n} (its ray start has not reported an address)"))
            continue
        if ip not in alive_ips and host not in alive_hosts and n not in alive_hosts:
            out.append((n, f"{n} ({ip})"))
    return out

while True:
    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        break
    except Exception as e:  # head still starting
        if time.time() > deadline:
            print(f"FAIL cannot connect to the Ray head at {address}: {e}")
            sys.exit(1)
        time.sleep(1)
last = -1
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    ips = {n["NodeManagerAddress"] for n in alive}
    hosts = {n["NodeManagerHostname"].split(".")[0] for n in alive}
    if len(alive) != last:
        print(f"PROGRESS {len(alive)}/{want}", flush=True)
        last = len(alive)
    if len(alive) >= want:
        res = ray.cluster_resources()
        print("NODES " + " ".join(sorted(f"{n['NodeManagerHostname']}={n['NodeManagerAddress']}" for n in alive)))
        print(f"RESOURCES cpus={int(res.get('CPU', 0))} gpus={int(res.get('GPU', 0))}")
        sys.exit(0)
    miss = missing(ips, hosts)
    dead = [n for n in step_dead() if n in {m for m, _ in miss}]
    if dead or time.time() > deadline:
        why = f"ray start exited on {', '.join(dead)}" if dead else f"timeout after {timeout:.0f}s"
        print(f"FAIL only {len(alive)}/{want} nodes joined ({why}); missing: {', '.join(d for _, d in miss)}")
        sys.exit(1)
    time.sleep(1)
PYEOF
JOIN_PID=$!
jrc=0
wait_for "$JOIN_PID" || jrc=$?
if ((jrc != 0)); then
    err "$(grep '^FAIL' "$CTL_DIR/join.out" | sed 's/^FAIL //' || true)"
    [[ -s $CTL_DIR/join.out ]] || err "node check ended with code $jrc and no output"
    err "the [node] lines above show each node's ray start output"
    EXIT_CODE=$EXIT_BRINGUP; exit "$EXIT_BRINGUP"
fi
log "all $NNODES node(s) joined: $(sed -n 's/^NODES //p' "$CTL_DIR/join.out")"
CLUSTER_GPUS=$(sed -n 's/^RESOURCES .*gpus=\([0-9]*\).*/\1/p' "$CTL_DIR/join.out")
CLUSTER_CPUS=$(sed -n 's/^RESOURCES cpus=\([0-9]*\).*/\1/p' "$CTL_DIR/join.out")
CLUSTER_GPUS=${CLUSTER_GPUS:-0} CLUSTER_CPUS=${CLUSTER_CPUS:-0}
log "cluster resources: ${CLUSTER_CPUS} CPUs, ${CLUSTER_GPUS} GPUs"

# ---- dashboard and how to reach it ---------------------------------------------------------
if [[ ${RAYTRAIN_DASHBOARD:-1} == 1 ]]; then
    log "Ray dashboard: http://$(rt_hostport "$HEAD_IP" "$DASH_PORT")"
    log "from your laptop: ssh -N -L 8265:$(rt_hostport "$HEAD_IP" "$DASH_PORT") ${USER:-$(id -un)}@${SLURM_SUBMIT_HOST:-LOGIN_NODE}   then open http://localhost:8265"
    log "log in with this job's token: the contents of $RAY_AUTH_TOKEN_PATH (readable only by you; deleted when the job ends)"
fi

# ---- trainer ----------------------------------------------------------------------------------
TRAIN=("$PY" -u -m "$MODULE" --address "$HEAD_ADDRESS")
if ((CLUSTER_GPUS > 0)); then
    has_flag --use-gpu || has_flag --no-use-gpu || TRAIN+=(--use-gpu)   # (use_gpu in --config counts too)
    DEFAULT_WORKERS=$CLUSTER_GPUS
else
    DEFAULT_WORKERS=$NNODES
fi
WORKERS=$DEFAULT_WORKERS
has_flag --num-workers && WORKERS=$(flag_value --num-workers)
has_flag --num-workers || TRAIN+=(--num-workers "$DEFAULT_WORKERS")
if ((CLUSTER_GPUS == 0)) && ! has_flag --cpus-per-worker && [[ $WORKERS == "$NNODES" ]]; then
    # CPU training, one worker per node: each worker takes all CPUs of a
    # node but one. That leaves a whole CPU per node for Ray Data's loading
    # tasks (a task needs 1 CPU on one node; halves on two nodes do not
    # count), and with 3+ CPUs per node Ray cannot pack two workers onto a
    # node. With 2 CPUs per node, workers may share a node: ask for 3+.
    cpw=$((MIN_CPUS > 1 ? MIN_CPUS - 1 : 1))
    ((NNODES > 1 && MIN_CPUS < 3)) && log "note: with $MIN_CPUS CPU(s) per node Ray may place two workers on one node; use --cpus-per-task=3 or more"
    TRAIN+=(--cpus-per-worker "$cpw")
fi
TRAIN+=("${ARGS[@]}")
log "trainer: ${TRAIN[*]}"
"${TRAIN[@]}" &
TRAINER_PID=$!
trc=0
wait_for "$TRAINER_PID" || trc=$?
TRAINER_PID=""
log "trainer exited with code $trc; run directory: $STORAGE/$NAME"
if ((trc == EXIT_STOPPED && GOT_USR1)); then
    log "the trainer stopped after a checkpoint on USR1: requeueing the job once Ray is stopped"
    REQUEUE=1
fi
EXIT_CODE=$trc
exit "$trc"
