"""GPU variant: ResNet-50 on one GPU, ours (Ray Train, 1 worker, --use-gpu) versus a plain loop.

    python bench/gpu_resnet50.py [--train-size 50000] [--epochs 3] [--batch-size 256] [--json FILE]

Refuses (exit 2) without CUDA. Runs, one after the other, each once (about 5-8
minutes on one modern GPU; well under 10):

* ours: `python -m raytrain_ddp.run --num-workers 1 --use-gpu --model resnet50`
  (via bench/ours_cli.py), synthetic data and the same data as PNG Parquet.
  The project has no bf16 / channels_last switch yet, so ours trains in fp32.
* plain: the same model, optimizer (SGD 0.02/0.9/5e-4), batch and data in a
  bare loop on the same GPU, twice: fp32 (the like-for-like ratio) and bf16
  autocast + channels_last (what such a switch would buy).

images/s = training rows / training-loop seconds of the epochs after the
first; both sides end each epoch with a device sync (ours: its end-of-epoch
loss check, the metrics.jsonl `samples_per_second`; plain: torch.cuda.synchronize()).
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
from common import NORM_MEAN, NORM_STD, SGD

ROOT = Path(__file__).resolve().parent.parent


def plain(args) -> None:
    """One plain run in this process; writes {"images_per_s": ...} to args.out."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from plain_ddp import ParquetImages
    from torch import nn
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data import synthetic
    from raytrain_ddp.data.pipeline import DataSpec, plan_data, synthetic_spec, to_model_inputs
    from raytrain_ddp.models import build_model

    device = torch.device("cuda:0")
    torch.manual_seed(0)
    fast = args.precision == "bf16"
    memory_format = torch.channels_last if fast else torch.contiguous_format
    config = TrainConfig(model="resnet50")
    model = build_model(config, synthetic_spec(config)).to(device, memory_format=memory_format)
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    loss_fn = nn.CrossEntropyLoss()
    if args.data == "synthetic":
        rows = synthetic.image_rows(np.arange(args.train_size), 0)
        spec = DataSpec("image", synthetic.IMAGE_SHAPE, synthetic.NUM_CLASSES, args.train_size, 0,
                        mean=NORM_MEAN, std=NORM_STD)
        inputs = to_model_inputs(rows, spec)
        dataset = TensorDataset(torch.from_numpy(inputs["x"]), torch.from_numpy(inputs["y"]))
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, pin_memory=True)
    else:
        plan = plan_data(TrainConfig(data=args.data))
        table = pq.ParquetDataset(list(plan.train_paths)).read(columns=["id", "image", "label"])
        dataset = ParquetImages(table, plan.spec, 0)
        loader = DataLoader(dataset, sampler=BatchSampler(RandomSampler(dataset), args.batch_size, drop_last=False),
                            batch_size=None, num_workers=args.loader_workers, pin_memory=True, persistent_workers=True)
    rates = []
    for _ in range(args.epochs):
        model.train()
        started, rows_seen = time.perf_counter(), 0
        for x, y in loader:
            x = x.to(device, non_blocking=True, memory_format=memory_format)
            y = y.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=fast):
                loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            rows_seen += len(y)
        torch.cuda.synchronize()
        rates.append(rows_seen / (time.perf_counter() - started))
    Path(args.out).write_text(json.dumps({"images_per_s": sum(rates[1:]) / len(rates[1:]), "per_epoch": rates}))


def _run(cmd: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=480).returncode
    if rc:
        sys.exit(f"{' '.join(cmd)} failed ({rc}); see the tail of {log}:\n" + log.read_text()[-3000:])


def ours(args, data: str, work: Path) -> float:
    name = f"ours-{Path(data).name}"
    cli = ["--num-workers", "1", "--use-gpu", "--model", "resnet50", "--epochs", str(args.epochs),
           "--batch-size", str(args.batch_size), "--storage-path", str(work / "runs"), "--name", name,
           "--no-tensorboard", "--no-report"]
    cli += ["--train-size", str(args.train_size), "--val-size", "512"] if data == "synthetic" else ["--data", data]
    _run([sys.executable, "-m", "bench.ours_cli", "--probe-out", str(work / f"{name}.probe.json"), "--", *cli],
         work / f"{name}.log")
    epochs = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return sum(e["samples_per_second"] for e in epochs[1:]) / len(epochs[1:])


def plain_subprocess(args, data: str, precision: str, work: Path) -> float:
    out = work / f"plain-{Path(data).name}-{precision}.json"
    _run([sys.executable, str(Path(__file__).resolve()), "--plain", "--data", data, "--precision", precision,
          "--train-size", str(args.train_size), "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
          "--loader-workers", str(args.loader_workers), "--out", str(out)], out.with_suffix(".log"))
    return json.loads(out.read_text())["images_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-size", type=int, default=50000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--loader-workers", type=int, default=4, help="plain DataLoader workers for Parquet")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # internal: one plain run
    parser.add_argument("--data", default="synthetic", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first is warm-up)")

    import torch

    if not torch.cuda.is_available():
        print("error: bench/gpu_resnet50.py needs a CUDA GPU and none is visible "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); use `python -m bench` on CPU",
              file=sys.stderr)
        return 2
    if args.plain:
        plain(args)
        return 0

    import numpy as np

    from raytrain_ddp.data import synthetic
    from raytrain_ddp.data.prepare import from_arrays

    results: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                     "train_size": args.train_size, "batch_size": args.batch_size, "epochs": args.epochs}
    with tempfile.TemporaryDirectory(prefix="raytrain-gpu-bench-") as tmp:
        work = Path(tmp)
        rows = synthetic.image_rows(np.arange(round(args.train_size / 0.9)), 0)
        parquet = str(work / "parquet")
        from_arrays(rows["image"], rows["label"], [str(c) for c in range(10)], parquet, val_fraction=0.1,
                    layout="NCHW", encoding="png")
        for data in ("synthetic", parquet):
            key = "synthetic" if data == "synthetic" else "parquet"
            figures = {"ours_fp32": ours(args, data, work),
                       "plain_fp32": plain_subprocess(args, data, "fp32", work),
                       "plain_bf16_channels_last": plain_subprocess(args, data, "bf16", work)}
            figures["ratio_fp32"] = figures["ours_fp32"] / figures["plain_fp32"]
            figures["ratio_vs_bf16"] = figures["ours_fp32"] / figures["plain_bf16_channels_last"]
            results[key] = figures
            print(f"{key}: ours {figures['ours_fp32']:,.0f} img/s, plain fp32 {figures['plain_fp32']:,.0f}, "
                  f"plain bf16+channels_last {figures['plain_bf16_channels_last']:,.0f}; "
                  f"ratio {figures['ratio_fp32']:.2f} (vs bf16: {figures['ratio_vs_bf16']:.2f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
