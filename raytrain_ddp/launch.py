"""`raytrain-ddp launch SCRIPT.py ARGS` (also `python -m raytrain_ddp.launch`), and `raytrain_ddp.launch(fn)`.

Your own training, unchanged, on the Ray cluster: a script runs once per worker exactly as torchrun runs it
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT set; your environment
and working directory); a function runs on every worker inside the process group the project set up. Both
get the run directory, the console, the watchdog, stop signals and Slurm requeue of a built-in run, and may
use :mod:`raytrain_ddp.session`. docs/launch.md compares it with torchrun, mp.spawn, Ray Train and Lightning.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.errors import ConfigError

PROG = "python -m raytrain_ddp.launch"
# The run settings that mean something for a script of one's own: where and how many, the run directory,
# restarts, the watchdog, trackers. The built-in loop's (model, data, optimizer...) are the script's business.
LAUNCH_FIELDS = (
    "num_workers",
    "use_gpu",
    "cpus_per_worker",
    "address",
    "storage_path",
    "name",
    "max_failures",
    "hang_timeout_s",
    "capacity_wait_s",
    "tensorboard",
    "mlflow_uri",
    "wandb_project",
    "wandb_entity",
    "verbose",
)
FLAG_NAMES = {"max_failures": "--max-restarts"}  # torchrun's word for it
DEFAULT_RESTARTS = 0  # as torchrun: a failure ends the run unless restarts are asked for
EXAMPLES = """\
examples:
  %(prog)s --num-workers 2 train.py --epochs 3      # CPU: gloo; the flags after the script are the script's
  %(prog)s --num-workers 8 --use-gpu train.py       # one worker per GPU; LOCAL_RANK indexes the GPU
  %(prog)s --max-restarts 3 train.py                # restart every rank after a lost process or node
  sbatch cluster/start_ray_slurm.sh launch train.py  # in a Slurm job: one worker per GPU the job holds

every rank's output: RUN_DIR/logs/rank-N.log (rank 0's on the console; --tee all: every rank's)

exit codes:
  0    every rank's script exited 0
  1    a rank failed (the line names it, with its error), or never called init_process_group
  2    bad input or a request the cluster cannot hold (nothing was started)
  74   the run directory's storage (a script's checkpoint folder's too) is full, over its quota or read-only,
       or its object store failed (EX_IOERR)
  75   stopped on SIGUSR1/SIGTERM (passed on to every rank): run the same command again to resume
  130  interrupted (Ctrl-C, passed on to every rank's script as SIGINT, with 30 s to exit)
"""


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    from raytrain_ddp.run import build_parser as trainer_parser

    parser = trainer_parser(
        prog=f"{prog} [run flags] SCRIPT.py [SCRIPT ARGS...]",
        description="Run your own training script once per worker on the Ray cluster, as torchrun would.",
        epilog=EXAMPLES,
        only=LAUNCH_FIELDS,
        flag_names=FLAG_NAMES,
    )
    parser.add_argument(
        "--tee", choices=("0", "all"), default="0", help="whose output the console shows: rank 0's (default) or all"
    )
    parser.add_argument("script", metavar="SCRIPT.py", help="the training script, run as python SCRIPT.py ARGS")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments")
    return parser


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    from raytrain_ddp.run import run_command

    def launch_script():
        given = vars(build_parser(prog).parse_args(argv))
        script, script_args, tee = script_path(given.pop("script")), given.pop("script_args"), given.pop("tee")
        config = _config(given.pop("config", None), given)  # both refused before torch and Ray are imported
        from raytrain_ddp.driver.fit import run
        from raytrain_ddp.driver.launch import LaunchedWork

        return run(config, LaunchedWork(script=script, script_args=script_args, tee=tee))

    return run_command(launch_script)


def run_settings(argv: list[str]) -> dict:
    """The run settings a launch command line chose (its --config file's, then its flags), not the script's:
    what the Slurm launcher plans the job by. Raises ConfigError, or SystemExit(2) for a bad flag."""
    from raytrain_ddp.config import load_toml

    given = vars(build_parser().parse_args(argv))
    for launch_only in ("script", "script_args", "tee"):
        given.pop(launch_only)
    config_file = given.pop("config", None)
    return {**(load_toml(config_file) if config_file else {}), **given}


def launch(target: Callable | str, args: Any = None, **settings: Any):
    """Run `target` on every worker and return a FitResult: a function is called as ``target(args)`` (``target()``
    when `args` is None) inside the process group the project set up; a script path runs as
    ``python target *args``. `settings`: the run's (num_workers, use_gpu, name, storage_path, max_restarts,
    hang_timeout_s, ...). Notebook-safe, as fit() is."""
    from raytrain_ddp.driver.fit import run
    from raytrain_ddp.driver.launch import LaunchedWork

    if "max_restarts" in settings:
        settings["max_failures"] = settings.pop("max_restarts")
    unknown = sorted(set(settings) - set(LAUNCH_FIELDS) - {"tee"})
    if unknown:
        raise ConfigError(f"launch() takes no setting {', '.join(unknown)}; it takes {', '.join(LAUNCH_FIELDS)}, tee")
    tee = settings.pop("tee", "0")
    config = _config(None, settings)
    if isinstance(target, str):
        work = LaunchedWork(script=target, script_args=[str(arg) for arg in args or ()], tee=tee)
    elif callable(target):
        work = LaunchedWork(function=target, function_args=args, tee=tee)
    else:
        raise ConfigError(f"launch() runs a function or a script's path, not {type(target).__name__}")
    return run(config, work)


def script_path(script: str) -> str:
    """The script as every worker finds it: an absolute path (workers start elsewhere)."""
    path = os.path.abspath(script)
    if not os.path.exists(path):
        raise ConfigError(f"{script}: no such file (give the path of the training script to run on every worker)")
    if not os.path.isfile(path):
        raise ConfigError(f"{script} is not a file: give the path of a Python script (python SCRIPT.py ARGS)")
    return path


def _config(config_file: str | None, settings: dict) -> TrainConfig:
    """Defaults (a launch restarts nothing unless asked), the TOML file, then the settings given."""
    from raytrain_ddp.config import load_toml

    values = {"max_failures": DEFAULT_RESTARTS, **(load_toml(config_file) if config_file else {}), **settings}
    return TrainConfig(**values).validate()


class _CallableModule(types.ModuleType):
    """`raytrain_ddp.launch` is both this module (python -m raytrain_ddp.launch) and the function: once the module
    is imported, Python binds the package's `launch` attribute to it, so the module itself must be callable."""

    def __call__(self, target: Callable | str, args: Any = None, **settings: Any):
        return launch(target, args, **settings)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
