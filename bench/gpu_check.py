"""The GPU check: `python -m bench.gpu_check [--out DIR]`, one deadline (9 minutes) for all of it.

Refuses (one line, exit 2) without CUDA. Steps, each in its own process with
what is left of the deadline, results to OUT/gpu_check.json and a Markdown
table on stdout (docs/gpu.md says where it goes):

1. environment: GPU, driver, torch, CUDA, cuDNN, NCCL versions;
2. setup: Ray from bench/gpu_wheels/*.tar.xz (carried with the working tree,
   made by bench/gpu_wheels.sh) into /tmp/raytrain-site, when `import ray` fails;
3. sync: synchronising calls per steady training step, counted with
   torch.cuda.set_sync_debug_mode("warn") (the loop's own micro_batch and
   optimizer_step, DDP on a one-rank NCCL group, batches already on the device);
4. resnet: a one-GPU Ray run, ResNet-18 bf16 + channels-last;
5. fsdp: the FSDP transformer bf16 run;
6. evaluate: step 4's checkpoint scored with --device cuda and --device cpu;
7. resnet50: bench/gpu_resnet50.py, ours vs plain, bf16 channels-last 224 px.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tarfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / "bench" / "gpu_wheels"
DEADLINE_S = 9 * 60
SYNC_STEPS = 20
SITE = Path("/tmp/raytrain-site")

log = logging.getLogger("bench.gpu_check")


def environment() -> dict:
    """Versions of everything the GPU path depends on (CUDA-free where no GPU is there)."""
    import torch

    found = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
    }
    if torch.cuda.is_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        found["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            found["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            found["driver"] = None
    return found


def unpack_carried(archives: list[Path], site: Path) -> list[str]:
    """Unpack the carried .tar.xz parts (wheels' contents) into `site`; returns the members' top-level names."""
    site.mkdir(parents=True, exist_ok=True)
    tops = set()
    for archive in archives:
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(site, filter="data")
            tops.update(name.split("/")[0] for name in tar.getnames())
    return sorted(tops)


def ray_env(site: Path) -> dict:
    """The environment child processes need to import Ray from `site` (empty when Ray imports already)."""
    try:
        import ray  # noqa: F401

        return {}
    except ImportError:
        archives = sorted(WHEELS.glob("*.tar.xz"))
        if not archives:
            raise SystemExit(
                f"error: Ray is not installed and {WHEELS} holds no .tar.xz parts (bench/gpu_wheels.sh makes them)"
            ) from None
        unpack_carried(archives, site)
        # ray.init() starts its own gcs_server and raylet binaries: no `ray` script is needed on PATH
        return {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def count_step_syncs(steps: int = SYNC_STEPS) -> dict:
    """Synchronising calls per steady step on the GPU (run in its own process: it starts a process group)."""
    import socket

    import torch
    import torch.distributed as dist

    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data.spec import synthetic_spec
    from raytrain_ddp.worker.args import UserCode
    from raytrain_ddp.worker.loop import RankTrainer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    config = TrainConfig(model="resnet18", precision="bf16", channels_last=True, batch_size=64)
    spec = synthetic_spec(config)
    trainer = RankTrainer(config, spec, device, UserCode(), world_size=1)
    batch = {
        "x": torch.randn(config.batch_size, *spec.input_shape, device=device),
        "y": torch.randint(spec.num_classes, (config.batch_size,), device=device),
    }
    for _ in range(3):  # warm-up: cudnn.benchmark's search and the allocator's first blocks synchronise
        trainer.micro_batch(batch, True)
        trainer.optimizer_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            trainer.micro_batch(batch, True)
            trainer.optimizer_step()
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    dist.destroy_process_group()
    return {"steps": steps, "synchronising_calls": len(syncs), "per_step": len(syncs) / steps, "first": syncs[:3]}


class Check:
    """Runs the steps against one deadline and keeps what each found."""

    def __init__(self, out: Path, deadline_s: float):
        self.out, self.ends = out, time.monotonic() + deadline_s
        self.results: dict = {}
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def left(self) -> float:
        return self.ends - time.monotonic()

    def run(self, name: str, command: list[str], share: float = 1.0) -> subprocess.CompletedProcess | None:
        """`command` with `share` of the time left (at most); its outcome goes into the results."""
        timeout = self.left() * share
        if timeout < 10:
            self.results[name] = {"ok": False, "error": "deadline reached before this step"}
            return None
        started = time.monotonic()
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=self.env)
        except subprocess.TimeoutExpired:
            self.results[name] = {"ok": False, "error": f"timed out after {timeout:.0f}s"}
            return None
        (self.out / f"{name}.log").write_text(done.stdout + done.stderr)
        self.results[name] = {"ok": done.returncode == 0, "seconds": round(time.monotonic() - started, 1)}
        if done.returncode:
            self.results[name]["error"] = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return done

    def train(self, name: str, share: float, *flags: str) -> None:
        run_dir = self.out / "runs" / name
        self.run(
            name,
            [
                sys.executable,
                "-m",
                "raytrain_ddp.run",
                "--use-gpu",
                "--num-workers",
                "1",
                "--storage-path",
                str(self.out / "runs"),
                "--name",
                name,
                "--no-report",
                "--no-tensorboard",
                *flags,
            ],
            share,
        )
        summary = run_dir / "summary.json"
        if summary.exists():
            found = json.loads(summary.read_text())
            self.results[name]["final"] = {k: found.get(k) for k in ("status", "best_checkpoint", "final_metrics")}

    def evaluate(self) -> None:
        best = self.results.get("resnet", {}).get("final", {}).get("best_checkpoint")
        if not best:
            self.results["evaluate"] = {"ok": False, "error": "no checkpoint from the resnet step"}
            return
        scores = {}
        for device in ("cuda", "cpu"):
            done = self.run(
                f"evaluate-{device}",
                [sys.executable, "-m", "raytrain_ddp.evaluate", best, "--device", device, "--json"],
                0.2,
            )
            if done is not None and done.returncode == 0:
                scores[device] = json.loads(done.stdout.strip().splitlines()[-1])
        self.results["evaluate"] = {
            "ok": len(scores) == 2,
            **{
                device: {
                    "val_accuracy": s["val_accuracy"],
                    "val_loss": s["val_loss"],
                    "recorded_val_accuracy": s["recorded"]["val_accuracy"],
                }
                for device, s in scores.items()
            },
        }


RESNET_RUN = (
    *("--model", "resnet18", "--precision", "bf16", "--channels-last"),
    *("--epochs", "2", "--train-size", "8192", "--val-size", "1024", "--batch-size", "256"),
)
FSDP_RUN = (
    *("--model", "transformer", "--dataset", "synthetic-tokens", "--strategy", "fsdp", "--precision", "bf16"),
    *("--optimizer", "adamw", "--lr", "0.003", "--epochs", "2", "--train-size", "8192", "--val-size", "1024"),
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "results/gpu_check"), help="where results go")
    parser.add_argument("--deadline-s", type=float, default=DEADLINE_S, help=argparse.SUPPRESS)
    parser.add_argument("--count-syncs", action="store_true", help=argparse.SUPPRESS)  # step 3, in a child
    parser.add_argument(
        "--setup-only",
        action="store_true",
        help="unpack the carried Ray parts present into /tmp/raytrain-site and stop",
    )
    return parser


def _run_steps(check: Check, out: Path) -> None:
    """The steps in order, each within its share of the deadline; results into check.results."""
    check.results["environment"] = environment()
    started = time.monotonic()
    check.env.update(ray_env(SITE))
    check.results["setup"] = {"ok": True, "seconds": round(time.monotonic() - started, 1)}
    done = check.run("sync", [sys.executable, "-m", "bench.gpu_check", "--count-syncs"], 0.15)
    if done is not None and done.returncode == 0:
        check.results["sync"].update(json.loads(done.stdout.strip().splitlines()[-1]))
    check.train("resnet", 0.25, *RESNET_RUN)
    check.train("fsdp", 0.3, *FSDP_RUN)
    check.evaluate()
    bench_json = out / "resnet50.json"
    deadline = str(max(check.left() - 20, 10))
    check.run(
        "resnet50", [sys.executable, "bench/gpu_resnet50.py", "--json", str(bench_json), "--deadline-s", deadline]
    )
    if bench_json.exists():
        check.results["resnet50"].update(json.loads(bench_json.read_text()))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.setup_only:
        print(json.dumps(ray_env(SITE)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"error: the GPU check needs a CUDA GPU; torch {torch.__version__} sees none", file=sys.stderr)
        return 2
    if args.count_syncs:
        print(json.dumps(count_step_syncs()))
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.deadline_s)
    _run_steps(check, out)
    (out / "gpu_check.json").write_text(json.dumps(check.results, indent=2) + "\n")
    print("| step | ok | seconds | found |\n|---|---|---|---|")
    for name, found in check.results.items():
        details = {k: v for k, v in found.items() if k not in ("ok", "seconds")}
        print(f"| {name} | {found.get('ok', '')} | {found.get('seconds', '')} | {json.dumps(details)[:300]} |")
    return 0 if all(found.get("ok", True) for found in check.results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
