"""`python -m raytrain_ddp.run` (also `raytrain-ddp train`): the command line.

Every flag is a field of TrainConfig; `--config FILE` reads a TOML file of the
same fields first, and flags given on the command line win.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import TYPE_CHECKING

from raytrain_ddp.config import TrainConfig, field_type, load_toml
from raytrain_ddp.driver import rank_processes
from raytrain_ddp.driver.signals import hold_early_stop_signals
from raytrain_ddp.errors import (  # noqa: F401 (EXIT_BAD_INPUT: the exit codes, together)
    EXIT_BAD_INPUT,
    EXIT_STORAGE_FULL,
    ConfigError,
    OneLineErrorParser,
    RunTakenOver,
    StorageFull,
    bad_input,
    one_line,
)
from raytrain_ddp.redact import RedactFilter

if TYPE_CHECKING:
    from raytrain_ddp.driver.fit import FitResult

PROG = "python -m raytrain_ddp.run"
# argparse writes the command's name for %(prog)s: `python -m raytrain_ddp.run` or `raytrain-ddp train`
EXAMPLES = """\
examples:
  %(prog)s --num-workers 2                  # CPU, built-in data and model
  %(prog)s --num-workers 2 --quick-start    # one machine, no Ray cluster: first step in seconds
  %(prog)s --num-workers 6 --use-gpu        # one worker per GPU, NCCL
  %(prog)s --data /shared/ds --model resnet18 --epochs 10
  %(prog)s --config runs/NAME/config.toml   # repeat a run exactly

exit codes:
  0    finished
  1    training failed (the error per rank is in the log and RUN_DIR/summary.json), or another
       driver took the run directory over (this one hung past the lock's stale limit)
  2    bad input or a request the cluster cannot hold (nothing was started)
  74   the run's storage is full, over its quota or read-only, or its object store failed (or a sharded
       checkpoint's write stalled) past the retry budget (EX_IOERR): the latest whole checkpoint is kept;
       free space (or make it writable, or bring the storage back) and run the same command again to resume
  75   stopped early on SIGUSR1/SIGTERM after a checkpoint (EX_TEMPFAIL):
       run the same command again to resume
  130  interrupted (Ctrl-C)
"""

# EXIT_BAD_INPUT (2) and EXIT_STORAGE_FULL (74) come with the one-line errors
EXIT_FAILED, EXIT_STOPPED, EXIT_INTERRUPTED = 1, 75, 130


def build_parser(
    prog: str = PROG,
    description: str = "Data-parallel PyTorch training on a Ray cluster (one worker per GPU or CPU slot).",
    epilog: str = EXAMPLES,
    only: tuple[str, ...] | None = None,
    flag_names: dict[str, str] | None = None,
) -> argparse.ArgumentParser:
    """The trainer's flags, one per TrainConfig field (`only` these; `flag_names`: a field's flag under another
    name, as `raytrain-ddp launch` calls max_failures --max-restarts, torchrun's word)."""
    parser = OneLineErrorParser(
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only flags the user typed reach the config
        allow_abbrev=False,  # `--stor` must not silently mean --storage-path
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file of these settings; flags override it")
    for f in fields(TrainConfig):
        if only is not None and f.name not in only:
            continue
        flag = (flag_names or {}).get(f.name) or "--" + f.name.replace("_", "-")
        kind = field_type(f)
        default = None if f.default is MISSING else f.default
        help_text = f"{f.metadata['help']} (default: {default})"
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(
                flag,
                dest=f.name,
                type=kind,
                choices=f.metadata.get("choices"),
                metavar=f.metadata.get("metavar", f.name.upper()),
                help=help_text,
            )
    return parser


def settings_from_args(argv: list[str] | None = None, *, allow_unknown: bool = False, prog: str = PROG) -> dict:
    """The settings the user chose: the TOML file's, then the flags typed (defaults left out). Raises ConfigError.

    allow_unknown: flags that are not the trainer's are left for another program (a launcher's custom module).
    """
    parser = build_parser(prog)
    given = vars(parser.parse_known_args(argv)[0] if allow_unknown else parser.parse_args(argv))
    config_file = given.pop("config", None)
    values = load_toml(config_file) if config_file else {}
    values.update(given)
    return values


def config_from_args(argv: list[str] | None = None, prog: str = PROG) -> TrainConfig:
    """Defaults, then the TOML file, then the flags. Raises ConfigError."""
    return TrainConfig(**settings_from_args(argv, prog=prog))


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """prog: the command's name in --help (`raytrain-ddp train` calls this too)."""

    def train():
        config = config_from_args(argv, prog).validate()
        if config.quick_start:  # the ranks import torch and meet while this process does (driver/rank_processes.py)
            rank_processes.start_early(config)
        try:
            from raytrain_ddp.driver.fit import fit  # imports Ray and torch: after the cheap checks

            return fit(config)
        finally:
            rank_processes.dismiss()  # those no run took

    return run_command(train)


def run_command(run: Callable[[], FitResult]) -> int:
    """A run from the command line (`train`, `launch`): the console set up, its outcome as the exit code, bad
    input as one line."""
    hold_early_stop_signals()  # before torch and Ray import: a Slurm USR1 then must not kill us
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    for handler in logging.getLogger().handlers:  # the console: Ray's and every module's lines, credentials masked
        handler.addFilter(RedactFilter())
    try:
        result = run()
    except ConfigError as err:
        return bad_input(err)
    except RunTakenOver as err:  # another driver went on with this run directory; this run stopped
        print(f"error: {one_line(err)}", file=sys.stderr)
        return EXIT_FAILED
    except StorageFull as err:  # before training started (the lock, config.toml): nothing to summarise
        print(f"Training failed: {one_line(err)}", file=sys.stderr)
        return EXIT_STORAGE_FULL
    except KeyboardInterrupt as interrupt:  # fit()'s says how far the run got; before it, there is nothing to say
        if sys.stderr.isatty():
            sys.stderr.write("\r\033[K")  # the line on its own, not after a progress line
        print(str(interrupt) or "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if result.stopped:
        return EXIT_STOPPED
    if result.storage_full:
        return EXIT_STORAGE_FULL
    return 0 if result.ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
