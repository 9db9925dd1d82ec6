#!/usr/bin/env bash
# ---------------------------------------------------------------------------
# One Slurm job = one Ray cluster = one training run.
#
#   sbatch [sbatch options] cluster/start_ray_slurm.sh [trainer args...]
#   e.g. sbatch --nodes=2 --gpus-per-node=3 cluster/start_ray_slurm.sh --epochs 10 --data /shared/ds
#
# Starts a Ray head on the first node and one Ray worker per other node (one
# background `srun` step per node, each given its node's CPUs and GPUs), waits
# until every node has joined, runs
#   python -u -m raytrain_ddp.run --address HEAD_IP:PORT --num-workers N [--use-gpu] <your args>
# on the head node, and stops this job's Ray processes when the job ends,
# however it ends. The job's exit code is the trainer's (0 ok, 1 training
# failed, 2 bad input/infeasible request, 75 stopped early after a checkpoint);
# 3 means the Ray cluster could not be brought up (the log says which node and
# why). USR1 (the time-limit warning) goes to the trainer, which checkpoints and
# exits 75; the job is then requeued and resumes from that checkpoint.
# All of it is raytrain_ddp/cluster/ (Python); docs/slurm.md explains it.
#
# Edit the defaults below, or override any of them on the sbatch command line.
#SBATCH --job-name=raytrain
#SBATCH --nodes=2                  # machines; one Ray node per machine
#SBATCH --ntasks-per-node=1        # keep 1: the one task per node is the Ray node
#SBATCH --gpus-per-node=3          # GPUs per node; one training worker per GPU (0 = CPU training)
#SBATCH --cpus-per-task=24         # CPUs per node: 1 per GPU worker + the rest (~7 per GPU) for Ray Data decoding
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
#   RAYTRAIN_NET_IFACE       network interface whose address Ray nodes (and NCCL) use (e.g. ib0)
#   RAYTRAIN_CPUS_PER_NODE / RAYTRAIN_GPUS_PER_NODE   override what Slurm says
#   RAYTRAIN_TMPDIR          base of Ray's per-job temp dir on each node (default /tmp; keep it short)
#   RAYTRAIN_JOB_DIR_BASE    shared, private dir for the job's auth token (default ~/.raytrain)
#   RAYTRAIN_JOIN_TIMEOUT    seconds to wait for all nodes to join (default 180)
#   RAYTRAIN_NETCHECK_TIMEOUT_S  seconds for the nodes' network check before Ray starts (default 30, 0: none)
#   RAYTRAIN_STOP_GRACE_S    seconds the trainer gets to checkpoint after a TERM (default 60)
#   RAYTRAIN_STOP_BEFORE_END_S  checkpoint and requeue this long before the time limit, USR1 or not (default 300)
#   RAYTRAIN_DASHBOARD       1/0: start the Ray dashboard on the head (default 1)
#   RAY_OBJECT_STORE_MEMORY  object store bytes per node (default: Ray's choice)
#   RAYTRAIN_DRY_RUN=1       print the plan (nodes, resources, ports, command) and exit
# ---------------------------------------------------------------------------
PY=${RAYTRAIN_PYTHON:-python}
if ! command -v "$PY" >/dev/null; then
    echo "[raytrain $(date +%H:%M:%S)] ERROR: python '$PY' not found on $(hostname -s); activate your environment" \
         "before sbatch or set RAYTRAIN_PYTHON" >&2
    exit 2
fi
# exec: Slurm's USR1 (--signal=B:...) then reaches the Python launcher itself.
exec "$PY" -m raytrain_ddp.cluster slurm "$@"
