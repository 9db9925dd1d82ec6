"""`python -m raytrain_ddp.checkpoint consolidate CHECKPOINT OUT`: a sharded checkpoint as one full file.

Writes the full format (raytrain_ddp/checkpoint/saver.py), on one process, without Ray: OUT itself when
it ends in .pt or .pth (what a plain ``torch.load(..., weights_only=True)`` reads), else the new directory
OUT holding OUT/checkpoint.pt (what `evaluate` and `--resume-from` read too). OUT must not exist: nothing
is overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from raytrain_ddp.checkpoint.consolidate import consolidate
from raytrain_ddp.checkpoint.layout import is_sharded
from raytrain_ddp.checkpoint.verify import read_verified
from raytrain_ddp.errors import ConfigError, OneLineErrorParser, bad_input
from raytrain_ddp.storage import location


def consolidate_checked(checkpoint: str, out: str) -> Path:
    """Consolidate after checking the checkpoint (consolidate itself refuses an OUT that exists). Raises
    ConfigError."""
    source = location(checkpoint, "CHECKPOINT")  # a local path, or a URI on object storage
    if not source.is_dir():
        raise ConfigError(f"{checkpoint!r} is not a checkpoint directory")
    if not is_sharded(source):
        raise ConfigError(f"{checkpoint!r} is not a sharded checkpoint (a full one is already one file)")
    _, why_not = read_verified(source)
    if why_not:
        raise ConfigError(f"{checkpoint!r} is not a usable checkpoint: {why_not}")
    return consolidate(source, out)


def main(argv: list[str] | None = None, prog: str = "python -m raytrain_ddp.checkpoint") -> int:
    """prog: the command's name in --help (`raytrain-ddp checkpoint` calls this too)."""
    parser = OneLineErrorParser(
        prog=prog,
        description="Work with checkpoints on one process.",
        epilog="examples:\n  %(prog)s consolidate runs/NAME/checkpoint_DATE runs/NAME/full.pt",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    command = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint as one full-format file: OUT.pt for torch.load, or OUT/checkpoint.pt, "
        "which evaluate and --resume-from read too",
    )
    command.add_argument("checkpoint", help="the sharded checkpoint's directory")
    command.add_argument(
        "out", help="the new file to write, when it ends in .pt or .pth; else a new directory, to hold checkpoint.pt"
    )
    args = parser.parse_args(argv)
    try:
        target = consolidate_checked(args.checkpoint, args.out)
    except ConfigError as err:
        return bad_input(err)
    print(f"wrote {target}" if target == Path(args.out) else f"wrote {target} (OUT {args.out} is a new directory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
