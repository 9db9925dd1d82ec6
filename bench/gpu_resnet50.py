"""GPU variant: ResNet-50 on one GPU, ours (Ray Train, 1 worker, --use-gpu) versus a plain loop.

    python bench/gpu_resnet50.py [--train-size 8192] [--epochs 3] [--batch-size 256] [--json FILE] [--deadline-s 480]

Refuses (exit 2) without CUDA. Both sides train the same model, optimizer
(SGD 0.02/0.9/5e-4), batch and data, in bf16 autocast with channels-last
memory format, on 224x224 images (the built-in synthetic 32x32 images, each
pixel repeated 7x7: big enough that the GPU, not the host, sets the pace),
read from the same Parquet dataset of raw uint8 pixels (no decode cost):

* ours: `python -m raytrain_ddp.run --num-workers 1 --use-gpu --model resnet50
  --precision bf16 --channels-last --data PARQUET` (via bench/ours_cli.py);
* plain: the Parquet rows in memory, a DataLoader with pinned memory, a bare loop.

images/s = training rows / training-loop seconds of the epochs after the
first; both sides end each epoch with a device sync (ours: its end-of-epoch
loss check, the metrics.jsonl `samples_per_second`; plain: torch.cuda.synchronize()).
One deadline (--deadline-s) covers the whole script: each run gets what is left.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_path  # noqa: F401  (repo root on sys.path)
from common import SGD

ROOT = Path(__file__).resolve().parent.parent


def plain(args) -> None:
    """One plain run in this process; writes {"images_per_s": ...} to args.out."""
    import pyarrow.parquet as pq
    import torch
    from plain_ddp import ParquetImages
    from torch import nn
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data.spec import plan_data
    from raytrain_ddp.models import build_model
    from raytrain_ddp.worker import strategy

    device = torch.device("cuda:0")
    torch.manual_seed(0)
    config = TrainConfig(data=args.data, model="resnet50", precision="bf16", channels_last=True)
    strategy.setup_device(config, device)  # cudnn.benchmark and TF32, as ours
    plan = plan_data(config)
    model = build_model(config, plan.spec).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    loss_fn = nn.CrossEntropyLoss()
    table = pq.ParquetDataset(list(plan.train_paths)).read(columns=["id", "image", "label"])
    dataset = ParquetImages(table, plan.spec, 0)
    loader = DataLoader(
        dataset,
        sampler=BatchSampler(RandomSampler(dataset), args.batch_size, drop_last=False),
        batch_size=None,
        num_workers=args.loader_workers,
        pin_memory=True,
        persistent_workers=True,
    )
    rates = []
    for _ in range(args.epochs):
        model.train()
        started, rows_seen = time.perf_counter(), 0
        for x, y in loader:
            x = x.to(device, non_blocking=True, memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            rows_seen += len(y)
        torch.cuda.synchronize()
        rates.append(rows_seen / (time.perf_counter() - started))
    Path(args.out).write_text(json.dumps({"images_per_s": sum(rates[1:]) / len(rates[1:]), "per_epoch": rates}))


def _run(cmd: list[str], log: Path, ends: float) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        try:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=max(ends - time.monotonic(), 1)
            ).returncode
        except subprocess.TimeoutExpired:
            sys.exit(f"{' '.join(cmd)} ran past the deadline; see the tail of {log}:\n" + log.read_text()[-3000:])
    if rc:
        sys.exit(f"{' '.join(cmd)} failed ({rc}); see the tail of {log}:\n" + log.read_text()[-3000:])


def ours(args, data: str, work: Path, ends: float) -> float:
    name = "ours"
    cli = [
        "--num-workers",
        "1",
        "--use-gpu",
        "--model",
        "resnet50",
        "--precision",
        "bf16",
        "--channels-last",
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--data",
        data,
        "--storage-path",
        str(work / "runs"),
        "--name",
        name,
        "--no-tensorboard",
        "--no-report",
    ]
    _run(
        [sys.executable, "-m", "bench.ours_cli", "--probe-out", str(work / f"{name}.probe.json"), "--", *cli],
        work / f"{name}.log",
        ends,
    )
    epochs = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return sum(e["samples_per_second"] for e in epochs[1:]) / len(epochs[1:])


def plain_subprocess(args, data: str, work: Path, ends: float) -> float:
    out = work / "plain.json"
    _run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--plain",
            "--data",
            data,
            "--epochs",
            str(args.epochs),
            "--batch-size",
            str(args.batch_size),
            "--loader-workers",
            str(args.loader_workers),
            "--out",
            str(out),
        ],
        out.with_suffix(".log"),
        ends,
    )
    return json.loads(out.read_text())["images_per_s"]


def _imagenet_sized_parquet(train_size: int, work: Path) -> str:
    """The built-in images blown up to 224 px (uint8 NCHW, raw) as Parquet, 10% of them validation."""
    import numpy as np

    from raytrain_ddp.data import synthetic
    from raytrain_ddp.data.prepare import from_arrays

    rows = synthetic.image_rows(np.arange(round(train_size / 0.9)), 0)
    images = rows["image"].repeat(7, axis=2).repeat(7, axis=3)  # 32 -> 224 px
    parquet = str(work / "parquet")
    labels = [str(c) for c in range(10)]
    from_arrays(images, rows["label"], labels, parquet, val_fraction=0.1, layout="NCHW", encoding="raw")
    return parquet


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-size", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--loader-workers", type=int, default=4, help="plain DataLoader workers for Parquet")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--deadline-s", type=float, default=480, help="seconds for the whole script")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # internal: one plain run
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ends = time.monotonic() + args.deadline_s
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first is warm-up)")

    import torch

    if not torch.cuda.is_available():
        print(
            "error: bench/gpu_resnet50.py needs a CUDA GPU and none is visible "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use `python -m bench` on CPU",
            file=sys.stderr,
        )
        return 2
    if args.plain:
        plain(args)
        return 0

    results: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "image_px": 224,
        "precision": "bf16",
        "channels_last": True,
        "train_size": args.train_size,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
    }
    with tempfile.TemporaryDirectory(prefix="raytrain-gpu-bench-") as tmp:
        work = Path(tmp)
        parquet = _imagenet_sized_parquet(args.train_size, work)
        results["ours"] = ours(args, parquet, work, ends)
        results["plain"] = plain_subprocess(args, parquet, work, ends)
        results["ratio"] = results["ours"] / results["plain"]
        print(
            f"ResNet-50 bf16 channels-last 224 px: ours {results['ours']:,.0f} img/s, "
            f"plain {results['plain']:,.0f}; ratio {results['ratio']:.3f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
