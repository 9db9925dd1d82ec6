"""From a killed worker to the first trained step after the resume, with checkpoints every minute.

    python -m bench.resume_after_kill                  # FSDP, the built-in transformer at dim 768, depth 8
    python -m bench.resume_after_kill --dim 64 --depth 1 --kills 1 --minutes 0.1   # a quick look

The trainer runs as a user runs it (`python -m raytrain_ddp.run`, its own local Ray, 2 CPU workers,
sharded checkpoints, `--checkpoint-every-minutes 1` by default); a worker hook (StepClock) has rank zero write the
time of each optimizer step. Each round waits for a new interval checkpoint, lets the run train a few steps
past it, then SIGKILLs one Ray Train worker process; Ray Train ends the group and starts it again from that
checkpoint. Measured: seconds from the kill to the end of the first optimizer step after it, and the steps
trained again (those after the checkpoint, which the kill lost).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT
from raytrain_ddp.worker.hooks import HOOKS_ENV, WorkerHooks

DIM_DEPTH_ENV = "RAYTRAIN_BENCH_TRANSFORMER"  # "dim:depth", read by wide_transformer in the workers too
STEP_CLOCK_ENV = "RAYTRAIN_BENCH_STEP_CLOCK"  # the file StepClock appends "time step" lines to


class StepClock(WorkerHooks):
    """Rank zero appends `time.time() step` after each optimizer step (a line, flushed: a kill loses none)."""

    def __init__(self) -> None:
        self.path = os.environ[STEP_CLOCK_ENV]

    def on_optimizer_step(self, rank: int, epoch: int, step: int) -> None:
        if rank == 0:
            with open(self.path, "a") as clock:
                clock.write(f"{time.time()} {step}\n")


def _transformer(dim: int, depth: int):
    from raytrain_ddp.data import synthetic
    from raytrain_ddp.models import TransformerLM

    return TransformerLM(synthetic.VOCAB_SIZE, synthetic.SEQUENCE_LENGTH, dim=dim, depth=depth, heads=8)


def wide_transformer(config):
    """The built-in transformer, wider and deeper (`--model bench.resume_after_kill:wide_transformer`)."""
    dim, depth = (int(n) for n in os.environ[DIM_DEPTH_ENV].split(":"))
    return _transformer(dim, depth)


def _worker_pids(trainer: int) -> list[int]:
    """This run's Ray Train worker processes: under its driver (whose local Ray's raylet starts them), not
    another Ray's on this machine."""
    parents, titles = {}, {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
                titles[int(entry.name)] = (entry / "cmdline").read_bytes()
            except (OSError, ValueError):
                continue

    def under_trainer(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == trainer:
                return True
        return False

    return [pid for pid, title in titles.items() if b"RayTrainWorker" in title and under_trainer(pid)]


def _steps(clock: Path) -> list[tuple[float, int]]:
    """(time, optimizer step) of each step rank zero finished, in order (a restart's steps again)."""
    if not clock.exists():
        return []
    lines = [line.split() for line in clock.read_text().splitlines()]
    return [(float(line[0]), int(line[1])) for line in lines if len(line) == 2]


def _latest_recorded(run_dir: Path) -> str | None:
    """The checkpoint Ray Train would resume from now (written and reported), by its directory's name."""
    from raytrain_ddp.checkpoint.registry import read_snapshot

    try:
        snapshot = read_snapshot(run_dir)
    except Exception:  # being replaced at this moment: look again
        return None
    return ((snapshot or {}).get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")


def _wait(what: str, ready, timeout: float, trainer: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if trainer.poll() is not None:
            raise SystemExit(f"the run ended ({trainer.returncode}) while waiting for {what}")
        if value := ready():
            return value
        time.sleep(0.1)
    raise SystemExit(f"no {what} within {timeout:.0f}s")


def measure(args: dict, work: Path) -> dict:
    run_dir, clock = work / "kill", work / "steps.txt"
    command = [
        *(sys.executable, "-m", "raytrain_ddp.run", "--num-workers", "2", "--strategy", "fsdp"),
        *("--dataset", "synthetic-tokens", "--model", "bench.resume_after_kill:wide_transformer"),
        *("--checkpoint-format", "sharded", "--checkpoint-every-minutes", str(args["minutes"])),
        *("--batch-size", str(args["batch_size"]), "--train-size", str(args["train_size"]), "--val-size", "64"),
        *("--epochs", "1", "--max-failures", str(args["kills"])),
        *("--storage-path", str(work), "--name", "kill", "--no-report", "--no-tensorboard"),
    ]
    env = {
        **os.environ,
        DIM_DEPTH_ENV: f"{args['dim']}:{args['depth']}",
        HOOKS_ENV: "bench.resume_after_kill:StepClock",
        STEP_CLOCK_ENV: str(clock),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("RAY_ADDRESS", None)  # a fresh local Ray of its own
    rounds = []
    with open(work / "trainer.log", "w") as log:
        trainer = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(args["kills"]):
                seen = _latest_recorded(run_dir)
                _wait("new checkpoint", lambda seen=seen: _latest_recorded(run_dir) not in (None, seen), 600, trainer)
                past = len(_steps(clock)) + args["steps_past"]
                _wait("steps past the checkpoint", lambda past=past: len(_steps(clock)) >= past, 600, trainer)
                victim = _wait("Ray Train worker", lambda: _worker_pids(trainer.pid), 60, trainer)[-1]
                os.kill(victim, signal.SIGKILL)
                killed = time.time()
                before = max(step for at, step in _steps(clock) if at < killed)
                # the restart's first step comes again at or before `before`: a step in flight when the kill
                # landed may still end just after it, numbered on
                after = _wait(
                    "a step trained again",
                    lambda at=killed, before=before: [s for s in _steps(clock) if s[0] > at and s[1] <= before],
                    900,
                    trainer,
                )
                first_at, first_step = after[0]
                last_step = max(step for at, step in _steps(clock) if at < first_at)  # that step counts too
                again = last_step - first_step + 1
                waited = first_at - killed
                rounds.append(
                    {"kill_to_first_step_s": waited, "resumed_at_step": first_step, "steps_trained_again": again}
                )
                print(f"kill -> first step {waited:.1f}s (step {first_step}); {again} step(s) trained again")
        finally:
            trainer.send_signal(signal.SIGINT)  # Ctrl-C: the run stops its workers and says so
            try:
                trainer.wait(timeout=120)
            except subprocess.TimeoutExpired:
                trainer.kill()
    parameters = sum(p.numel() for p in _transformer(args["dim"], args["depth"]).parameters())
    return {"parameters": parameters, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--kills", type=int, default=2, help="kill a worker this many times")
    parser.add_argument("--minutes", type=float, default=1.0, help="--checkpoint-every-minutes")
    parser.add_argument("--steps-past", type=int, default=3, help="steps trained past a checkpoint before a kill")
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch per worker")
    parser.add_argument("--train-size", type=int, default=20000, help="rows: more than the run needs")
    parser.add_argument("--json", help="also write the results here")
    args = vars(parser.parse_args())
    with tempfile.TemporaryDirectory(prefix="bench-kill-") as scratch:
        result = measure(args, Path(scratch))
    waits = [r["kill_to_first_step_s"] for r in result["rounds"]]
    print(
        f"FSDP, 2 CPU workers, transformer {result['parameters'] / 1e6:.1f} M parameters, sharded checkpoints "
        f"every {args['minutes']:g} minute(s): kill -> first trained step {statistics.median(waits):.1f}s "
        f"(median of {len(waits)}: {', '.join(f'{w:.1f}' for w in waits)})"
    )
    if args["json"]:
        Path(args["json"]).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
