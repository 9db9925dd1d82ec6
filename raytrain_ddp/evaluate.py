"""`python -m raytrain_ddp.evaluate CHECKPOINT`: score a checkpoint on one process.

Rebuilds the model and the validation split from what the checkpoint records,
evaluates without Ray or DDP (on the GPU when there is one, ``--device``), under
the precision training used, and prints the accuracy beside the one recorded
at training time: they agree, because training validated every row exactly
once with rank zero's weights and buffers (within the tolerance docs/gpu.md
gives when a GPU-trained, TF32 or bf16, checkpoint is scored on a CPU).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from raytrain_ddp.checkpoint.consolidate import load_model_weights
from raytrain_ddp.checkpoint.layout import CHECKPOINT_FILE, is_sharded
from raytrain_ddp.checkpoint.state import resume_point
from raytrain_ddp.checkpoint.verify import read_verified
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.spec import DataSpec, read_split_rows, to_model_inputs
from raytrain_ddp.errors import ConfigError, OneLineErrorParser, bad_input, plural
from raytrain_ddp.models import build_model
from raytrain_ddp.storage import location
from raytrain_ddp.worker import strategy
from raytrain_ddp.worker.loop import make_loss_fn
from raytrain_ddp.worker.metrics import evaluate


def pick_device(name: str | None) -> torch.device:
    """--device: cuda when there is a GPU (the default), else cpu. Raises ConfigError for cuda without one."""
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but torch sees no CUDA GPU; use --device cpu")
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


@torch.no_grad()
def evaluate_checkpoint(path: str, batch_size: int = 256, device: str | None = None) -> dict:
    """Validation loss and accuracy of the checkpoint at `path` (file or directory, full or sharded) on `device`."""
    target = pick_device(device)
    given = location(path, "CHECKPOINT")  # a local path, or a URI on object storage
    if given.is_file() and given.name != CHECKPOINT_FILE:
        raise ConfigError(f"{path!r} is not a checkpoint: give a checkpoint directory or its {CHECKPOINT_FILE}")
    checkpoint_dir = given.parent if given.is_file() else given
    state, why_not = read_verified(checkpoint_dir)
    if state is None:
        raise ConfigError(f"{path!r} is not a usable checkpoint: {why_not}")
    config = TrainConfig(**state["config"])
    spec = DataSpec(**state["data_spec"])
    if spec.kind == "custom":
        raise ConfigError(f"{path} was trained on a --dataset plug-in's data; evaluate it with your own data loader")
    strategy.setup_device(config, target)  # TF32 as in training (--no-tf32 runs stay full fp32)
    model = build_model(config, spec)
    if is_sharded(checkpoint_dir):
        load_model_weights(checkpoint_dir, model)
    else:
        model.load_state_dict(state["model"])
    memory_format = torch.channels_last if config.channels_last else torch.preserve_format
    model.to(target, memory_format=memory_format)
    rows = to_model_inputs(read_split_rows(config, "val"), spec)
    x, y = torch.from_numpy(rows["x"]), torch.from_numpy(rows["y"])
    batches = (
        {"x": x[start : start + batch_size].to(target), "y": y[start : start + batch_size].to(target)}
        for start in range(0, len(y), batch_size)
    )
    with strategy.autocast(config, target):
        scored = evaluate(model, batches, make_loss_fn(config), target)
    return {"epoch": state["epoch"], **scored, "device": str(target), "recorded": state["metrics"]}


def main(argv: list[str] | None = None, prog: str = "python -m raytrain_ddp.evaluate") -> int:
    """prog: the command's name in --help (`raytrain-ddp evaluate` calls this too)."""
    parser = OneLineErrorParser(
        prog=prog,
        description="Score a checkpoint on one process, beside the accuracy recorded at training time.",
        epilog="examples:\n  %(prog)s runs/NAME/checkpoint_DATE/checkpoint.pt"
        "\n  %(prog)s runs/NAME/checkpoint_DATE --device cpu --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "checkpoint", help="checkpoint.pt or the checkpoint directory holding it, or a sharded checkpoint's directory"
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), help="where to evaluate (default: cuda if available)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    try:
        result = evaluate_checkpoint(args.checkpoint, device=args.device)
    except ConfigError as err:
        return bad_input(err)
    if args.json:
        print(json.dumps(result))
    else:
        print(describe_result(result))
    return 0


def describe_result(result: dict) -> str:
    """The score, beside the one recorded at the checkpoint; a mid-epoch checkpoint recorded none (its
    ranking metric holds a placeholder, -inf or inf), and its weights are from inside the next epoch."""
    recorded = result["recorded"]
    where = f"over {plural(result['val_rows'], 'row')} on {result['device']}"
    if recorded.get("step_in_epoch"):
        return (
            f"{resume_point(result['epoch'], recorded['step_in_epoch'])} (a mid-epoch checkpoint, no validation "
            f"recorded): val_accuracy {result['val_accuracy']:.4f}, val_loss {result['val_loss']:.4f} {where}"
        )
    return (
        f"epoch {result['epoch']}: val_accuracy {result['val_accuracy']:.4f} "
        f"(recorded {recorded['val_accuracy']:.4f}), val_loss {result['val_loss']:.4f} "
        f"(recorded {recorded['val_loss']:.4f}) {where}"
    )


if __name__ == "__main__":
    sys.exit(main())
