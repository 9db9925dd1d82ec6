#!/usr/bin/env bash
# CIFAR-10 ResNet-18 on a Slurm cluster: prepare the data once, then submit one job.
#
#   examples/cifar10_resnet_slurm.sh ~/data/cifar-10-batches-py /shared/$USER/cifar10 [trainer args...]
#
# 1. Converts the CIFAR-10 python batches already on disk (compute nodes
#    rarely reach the internet: download them on a login node) into a Parquet
#    dataset on storage every node sees; skipped when it is already there.
# 2. Submits cluster/start_ray_slurm.sh: one worker per GPU on every node,
#    ResNet-18, 30 epochs, cosine schedule after a 1-epoch warm-up, bf16, and
#    the learning rate scaled with the global batch (--scale-lr: 0.05 per
#    worker's 64 images). Extra arguments go to the trainer and win.
#
# SBATCH_ARGS changes the allocation (default "--nodes=2 --gpus-per-node=1").
# Watch it: the job log prints the dashboard URL and the ssh tunnel to reach it.
set -euo pipefail
cifar_dir=${1:?usage: $0 CIFAR10_BATCHES_DIR DATASET_DIR [trainer args...]}
dataset_dir=${2:?usage: $0 CIFAR10_BATCHES_DIR DATASET_DIR [trainer args...]}
shift 2
repo=$(cd "$(dirname "$0")/.." && pwd)

if [[ ! -e $dataset_dir ]]; then
    python -m raytrain_ddp.data prepare --from cifar10 "$cifar_dir" --out "$dataset_dir"
fi
python -m raytrain_ddp.data inspect "$dataset_dir"

read -ra sbatch_args <<<"${SBATCH_ARGS:---nodes=2 --gpus-per-node=1}"
sbatch "${sbatch_args[@]}" "$repo/cluster/start_ray_slurm.sh" \
    --data "$dataset_dir" --model resnet18 --epochs 30 --batch-size 64 \
    --lr 0.05 --scale-lr --lr-schedule cosine --warmup-epochs 1 --precision bf16 "$@"
