"""`raytrain-ddp COMMAND` (also `python -m raytrain_ddp COMMAND`): every entry point under one command.

Each command hands its arguments to the module's own `main(argv)`, which parses them: the flags, their
help and their errors live in one place, and `python -m raytrain_ddp.run` etc. work as before.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from raytrain_ddp.errors import EXIT_BAD_INPUT

PROG = "raytrain-ddp"


def _train(argv: list[str]) -> int:
    from raytrain_ddp import run

    return run.main(argv, prog=f"{PROG} train")


def _launch(argv: list[str]) -> int:
    from raytrain_ddp import launch

    return launch.main(argv, prog=f"{PROG} launch")


def _data(command: str) -> Callable[[list[str]], int]:
    def data_main(argv: list[str]) -> int:
        from raytrain_ddp.data import cli

        return cli.main([command, *argv], prog=PROG)

    return data_main


def _evaluate(argv: list[str]) -> int:
    from raytrain_ddp import evaluate

    return evaluate.main(argv, prog=f"{PROG} evaluate")


def _checkpoint(argv: list[str]) -> int:
    from raytrain_ddp.checkpoint import cli as checkpoint

    return checkpoint.main(argv, prog=f"{PROG} checkpoint")


def _report(argv: list[str]) -> int:
    from raytrain_ddp import report

    return report.main(argv, prog=f"{PROG} report")


def _status(argv: list[str]) -> int:
    from raytrain_ddp.cluster import status

    return status.main(["status", *argv], prog=PROG)


def _slurm(argv: list[str]) -> int:
    from raytrain_ddp.cluster import slurm

    return slurm.main(argv, prog=f"{PROG} slurm")


# name: (what it does, its entry point, an example)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int], str]] = {
    "train": ("train a model on the Ray cluster (python -m raytrain_ddp.run)", _train, "train --num-workers 2"),
    "launch": (
        "run your own training script on every worker, as torchrun would",
        _launch,
        "launch --num-workers 2 train.py --epochs 3",
    ),
    "prepare": (
        "convert images, CIFAR-10 or a CSV file into a Parquet dataset",
        _data("prepare"),
        "prepare --from imagefolder ./images --out /shared/ds",
    ),
    "inspect": ("check a dataset and describe it", _data("inspect"), "inspect /shared/ds"),
    "evaluate": ("score a checkpoint on one process", _evaluate, "evaluate runs/NAME/checkpoint_DATE"),
    "checkpoint": (
        "consolidate a sharded checkpoint into one file",
        _checkpoint,
        "checkpoint consolidate runs/NAME/checkpoint_DATE ./full",
    ),
    "report": ("rebuild a run's HTML report", _report, "report runs/NAME"),
    "status": ("what the Ray cluster holds, how many workers fit", _status, "status --address 10.0.0.1:6379"),
    "slurm": ("inside a Slurm job: Ray on its nodes, then the trainer", _slurm, "slurm --epochs 10"),
}


def help_text() -> str:
    width = max(map(len, COMMANDS))
    commands = "\n".join(f"  {name:<{width}}  {what}" for name, (what, _, _) in COMMANDS.items())
    examples = "\n".join(f"  {PROG} {example}" for _, _, example in COMMANDS.values())
    return (
        f"usage: {PROG} COMMAND [ARGS]    ({PROG} COMMAND --help: its flags and examples)\n\n"
        f"Data-parallel PyTorch training on one machine, a Ray cluster or a Slurm allocation.\n\n"
        f"commands:\n{commands}\n\nexamples:\n{examples}\n"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(help_text(), end="")
        return 0
    if not argv or argv[0] not in COMMANDS:
        what = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"error: {what}; choose one of: {', '.join(COMMANDS)} (see --help)", file=sys.stderr)
        return EXIT_BAD_INPUT
    return COMMANDS[argv[0]][1](argv[1:])
