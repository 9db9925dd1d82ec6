"""Bad input: one line naming the flag and what is allowed, exit code 2, nothing started or written."""

from __future__ import annotations

import os

import pytest
from support import run_cli


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


CASES = [
    # (id, args, what the one line must say)
    ("zero-workers", ["--num-workers", "0"], "--num-workers must be at least 1, got 0"),
    ("negative-workers", ["--num-workers", "-3"], "--num-workers must be at least 1, got -3"),
    ("zero-batch", ["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    ("zero-epochs", ["--epochs", "0"], "--epochs must be at least 1"),
    ("negative-lr", ["--lr", "-0.1"], "--lr must be > 0"),
    ("zero-cpus", ["--cpus-per-worker", "0"], "--cpus-per-worker must be > 0"),
    ("unknown-model", ["--model", "vgg99"], "--model 'vgg99' is unknown; choose one of: cnn"),
    ("unknown-dataset", ["--dataset", "imagenet"], "--dataset 'imagenet' is unknown; choose one of: synthetic"),
    ("zero-grad-accum", ["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
    ("unknown-precision", ["--precision", "fp8"], "argument --precision: invalid choice: 'fp8'"),
    ("unknown-strategy", ["--strategy", "zero3"], "argument --strategy: invalid choice: 'zero3'"),
    ("negative-clip", ["--clip-grad-norm", "-1"], "--clip-grad-norm must be > 0, got -1.0"),
    ("zero-peak", ["--peak-tflops", "0"], "--peak-tflops must be > 0, got 0.0"),
    ("negative-warmup", ["--warmup-epochs", "-1"], "--warmup-epochs must be >= 0"),
    ("loss-not-a-path", ["--loss", "mse"], "--loss 'mse' is not an import path like pkg.module:fn"),
    ("task-not-a-path", ["--task", "regression"], "--task 'regression' is not an import path like pkg.module:Task"),
    ("task-without-its-steps", ["--task", "json:JSONDecoder"], "--task 'json:JSONDecoder': JSONDecoder has no "),
    (
        "model-module-missing",
        ["--model", "nosuchpkg.models:build"],
        "--model 'nosuchpkg.models:build': cannot import nosuchpkg.models: ModuleNotFoundError",
    ),
    (
        "model-attribute-missing",
        ["--model", "json:build"],
        "--model 'json:build': module json has no attribute 'build'",
    ),
    ("model-not-callable", ["--model", "json:__version__"], "--model 'json:__version__' is a str, not a callable"),
    (
        "model-wrong-return",
        ["--model", "builtins:str"],
        "--model 'builtins:str' returned str, expected a torch.nn.Module",
    ),
    ("model-plugin-raises", ["--model", "builtins:len"], "--model 'builtins:len': raised TypeError"),
    (
        "model-data-mismatch",
        ["--model", "transformer"],
        "--model transformer takes tokens data, but the data holds image",
    ),
    # --quick-start: what needs a Ray cluster is refused before anything starts
    (
        "quick-start-address",
        ["--quick-start", "--address", "10.0.0.1:6379"],
        "--quick-start runs on this machine only; it cannot join --address 10.0.0.1:6379",
    ),
    (
        "quick-start-elastic",
        ["--quick-start", "--min-workers", "1"],
        "--quick-start cannot train elastically (--min-workers): it has no restarts",
    ),
    (
        "quick-start-remote-storage",
        ["--quick-start", "--storage-path", "s3://bucket/runs"],
        "--quick-start writes to a local --storage-path only, got 's3://bucket/runs'",
    ),
    (
        "quick-start-more-workers-than-cpus",
        ["--quick-start", "--num-workers", str((os.cpu_count() or 1) + 1)],
        f"--quick-start runs one process per CPU: {(os.cpu_count() or 1) + 1} workers asked, this machine has",
    ),
    (
        "quick-start-fsdp",
        ["--quick-start", "--strategy", "fsdp"],
        "--quick-start trains with DDP and full checkpoints only; run --strategy fsdp or --checkpoint-format sharded",
    ),
    (
        "quick-start-sharded-checkpoints",
        ["--quick-start", "--checkpoint-format", "sharded"],
        "--quick-start trains with DDP and full checkpoints only",
    ),
    (
        "quick-start-dataset-plugin",
        ["--quick-start", "--dataset", "json:loads"],
        "--quick-start reads the data in each rank's own process: a --dataset plug-in (json:loads) returns Ray",
    ),
    ("unknown-optimizer", ["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    ("not-a-number", ["--epochs", "three"], "argument --epochs: invalid int value: 'three'"),
    ("unknown-flag", ["--num-gpus", "2"], "unrecognized arguments: --num-gpus 2"),
    ("bad-name", ["--name", "../escape"], "--name '../escape' may hold only letters"),
    ("half-explicit-data", ["--train-data", "/x/train"], "--train-data and --val-data go together"),
    (
        "data-and-explicit",
        ["--data", "/x", "--train-data", "/x/t", "--val-data", "/x/v"],
        "either --data DIR or --train-data/--val-data",
    ),
    (
        "min-workers-above-max",
        ["--num-workers", "2", "--min-workers", "3"],
        "--min-workers must be between 1 and --num-workers (2), got 3",
    ),
    ("zero-min-workers", ["--min-workers", "0"], "--min-workers must be between 1 and --num-workers (2), got 0"),
    ("zero-capacity-wait", ["--capacity-wait-s", "0"], "--capacity-wait-s must be at least 1, got 0"),
    (
        "unreachable-address",
        ["--address", "127.0.0.1:1"],
        "cannot connect to the Ray cluster at 127.0.0.1:1: Connection refused",
    ),
    (
        "secret-in-a-message",
        ["--resume-from", "s3://AKIAXYZ:wJalrXUtnFEMI@bucket/ckpt"],
        "--resume-from 's3://***@bucket/ckpt'",  # looked up for real (no network here: the lookup fails)
    ),
    (
        "resume-from-missing",
        ["--resume-from", "/no/such/checkpoint"],
        "--resume-from '/no/such/checkpoint' does not exist",
    ),
    ("abbreviated-flag", ["--stor", "/tmp", "--num-workers", "0"], "unrecognized arguments: --stor /tmp"),
    ("bool-with-value", ["--use-gpu=yes"], "argument --use-gpu/--no-use-gpu: ignored explicit argument 'yes'"),
    ("unknown-lr-schedule", ["--lr-schedule", "linear"], "argument --lr-schedule: invalid choice: 'linear'"),
    ("name-too-long", ["--name", "a" * 250], "--name is 250 characters long; at most 200 fit"),
    ("momentum-one", ["--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
    ("negative-weight-decay", ["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    ("negative-seed", ["--seed", "-1"], "--seed must be at least 0, got -1"),
    ("negative-max-failures", ["--max-failures", "-1"], "--max-failures must be at least 0, got -1"),
    ("zero-num-to-keep", ["--num-to-keep", "0"], "--num-to-keep must be at least 1, got 0"),
    (
        "unknown-checkpoint-metric",
        ["--checkpoint-metric", "val_f1"],
        "--checkpoint-metric 'val_f1' is unknown; choose one of: val_accuracy, val_loss",
    ),
    ("unknown-checkpoint-mode", ["--checkpoint-mode", "best"], "argument --checkpoint-mode: invalid choice: 'best'"),
    (
        "unknown-checkpoint-format",
        ["--checkpoint-format", "zip"],
        "argument --checkpoint-format: invalid choice: 'zip'",
    ),
    (
        "negative-checkpoint-every-steps",
        ["--checkpoint-every-steps", "-5"],
        "--checkpoint-every-steps must be at least 0, got -5",
    ),
    (
        "negative-checkpoint-every-minutes",
        ["--checkpoint-every-minutes", "-1"],
        "--checkpoint-every-minutes must be >= 0, got -1.0",
    ),
    ("zero-collective-timeout", ["--collective-timeout-s", "0"], "--collective-timeout-s must be at least 1, got 0"),
    ("zero-hang-timeout", ["--hang-timeout-s", "0"], "--hang-timeout-s must be at least 1, got 0"),
    ("zero-val-size", ["--val-size", "0"], "--val-size must be at least 1, got 0"),
    (
        "fewer-rows-than-workers",
        ["--train-size", "1", "--num-workers", "2"],
        "--train-size holds 1 training rows, fewer than --num-workers 2",
    ),
    ("more-workers-than-machine", ["--num-workers", "500"], "--num-workers 500 x 1 CPU does not fit this machine"),
    ("data-missing", ["--data", "/no/such/dataset"], "/no/such/dataset"),
    ("empty-mlflow-uri", ["--mlflow-uri", ""], "--mlflow-uri must not be empty"),
    ("negative-log-every-steps", ["--log-every-steps", "-1"], "--log-every-steps must be at least 0, got -1"),
    ("empty-wandb-project", ["--wandb-project", ""], "--wandb-project must not be empty"),
    ("wandb-project-with-slash", ["--wandb-project", "team/proj"], "--wandb-project 'team/proj' may not hold '/'"),
    (
        "wandb-project-too-long",
        ["--wandb-project", "p" * 129],
        "--wandb-project is 129 characters long; W&B takes at most 128",
    ),
    ("wandb-entity-alone", ["--wandb-entity", "team"], "--wandb-entity goes with --wandb-project"),
    (
        "wandb-entity-with-space",
        ["--wandb-project", "p", "--wandb-entity", "my team"],
        "--wandb-entity 'my team' may not hold '/'",
    ),
    ("profile-steps-one-number", ["--profile-steps", "3"], "--profile-steps '3' is not A:B, two optimizer step"),
    ("profile-steps-not-integers", ["--profile-steps", "a:b"], "--profile-steps 'a:b' is not A:B"),
    ("profile-steps-fraction", ["--profile-steps", "1.5:3"], "--profile-steps '1.5:3' is not A:B"),
    ("profile-steps-negative", ["--profile-steps=-2:3"], "--profile-steps '-2:3' is not A:B"),
    ("profile-steps-from-zero", ["--profile-steps", "0:4"], "--profile-steps '0:4': steps count from 1, got 0"),
    ("profile-steps-backwards", ["--profile-steps", "5:3"], "--profile-steps '5:3': the last step B must not come"),
    (
        "profile-steps-too-many",
        ["--profile-steps", "1:1000"],
        "--profile-steps '1:1000' asks for 1000 steps; at most 50",
    ),
    (
        "profile-steps-huge",
        ["--profile-steps", "5000000000:5000000001"],
        "--profile-steps '5000000000:5000000001': steps must be at most 1e+09",
    ),
    ("profile-steps-empty", ["--profile-steps", ""], "--profile-steps must not be empty"),
]


def _numeric_cases() -> list[tuple]:
    """For every numeric flag: a value past its limit, and (float flags) NaN and infinity."""
    from dataclasses import fields

    from raytrain_ddp.config import TrainConfig, field_type

    cases = []
    for f in fields(TrainConfig):
        if field_type(f) not in (int, float):
            continue
        flag = "--" + f.name.replace("_", "-")
        extra = ["--num-workers", "100000"] if f.name == "min_workers" else []
        huge = str(int(f.metadata["maximum"]) * 10 + 1)
        cases.append((f"{f.name}-huge", [*extra, flag, huge], f"{flag} must be at most"))
        if field_type(f) is float:
            cases += [
                (f"{f.name}-{word}", [flag, word], f"{flag} must be a finite number, got {word}")
                for word in ("nan", "inf")
            ]
    return cases


NUMERIC_CASES = _numeric_cases()


# Run as the real command, in a process of its own: one case of each kind of check (the parser, the config's
# validation, the data and model plan, Ray's address, the machine's size, --resume-from). The rest call the
# same `main()` in this process (the same code, without ~2-9 s of interpreter start and imports per case).
IN_A_PROCESS = {
    "abbreviated-flag",
    "zero-workers",
    "model-data-mismatch",
    "unreachable-address",
    "more-workers-than-machine",
    "resume-from-missing",
    "lr-nan",
}


def cli_main(args: list[str], capsys) -> tuple[int, str]:
    """`python -m raytrain_ddp.run ARGS` in this process: (exit code, stderr). The command's signal handlers
    (it keeps an early stop signal) are put back afterwards."""
    import signal

    from raytrain_ddp import run
    from raytrain_ddp.driver.signals import STOP_SIGNALS

    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        code = run.main(args)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case_id, args, message", CASES + NUMERIC_CASES, ids=[c[0] for c in CASES + NUMERIC_CASES])
def test_bad_flag_is_one_line_and_exit_2(tmp_path, capsys, case_id, args, message):
    argv = ["--storage-path", str(tmp_path / "runs"), *args]
    if case_id in IN_A_PROCESS:
        result = run_cli("raytrain_ddp.run", *argv, timeout=60)
        code, stderr = result.returncode, result.stderr
    else:
        code, stderr = cli_main(argv, capsys)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and message in lines[0]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_wandb_project_without_wandb_installed_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails for real, as where it is not installed
    code, stderr = cli_main(["--storage-path", str(tmp_path / "runs"), "--wandb-project", "p"], capsys)
    assert (code, stderr) == (2, "error: --wandb-project needs the wandb package: pip install 'raytrain-ddp[wandb]'\n")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan"])
def test_a_bad_placement_wait_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch, value):
    monkeypatch.setenv("RAYTRAIN_PLACEMENT_WAIT_S", value)
    code, stderr = cli_main(["--storage-path", str(tmp_path / "runs")], capsys)
    assert (code, stderr) == (2, f"error: RAYTRAIN_PLACEMENT_WAIT_S={value!r}: give seconds between 1 and 3600\n")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def _checkpoint(directory, drop: tuple = (), **changes) -> str:
    """A checkpoint file laid out as rank zero writes one (cnn, built-in data), with `changes`, less `drop`."""
    import torch

    directory.mkdir()
    state = {
        "model": {},
        "optimizer": {},
        "scheduler": {},
        "scaler": {},
        "epoch": 1,
        "step_in_epoch": 0,
        "global_step": 32,
        "rng": {},
        "metrics": {},
        "config": {"model": "cnn", "name": "earlier"},
        "data_spec": {"input_shape": [3, 32, 32], "num_classes": 10},
        **changes,
    }
    torch.save({key: value for key, value in state.items() if key not in drop}, directory / "checkpoint.pt")
    return str(directory)


def _garbage(directory) -> str:
    directory.mkdir()
    (directory / "checkpoint.pt").write_bytes(b"not a torch file")
    return str(directory)


RESUME_FROM_CASES = [
    # (id, makes the --resume-from path in a directory, what the one line must say)
    ("empty-dir", lambda d: str(d.mkdir() or d), "is not a usable checkpoint: checkpoint.pt is missing"),
    ("garbage-file", lambda d: _garbage(d) + "/checkpoint.pt", "is not a usable checkpoint: it does not load"),
    ("keys-missing", lambda d: _checkpoint(d, drop=("optimizer",)), "keys missing: optimizer"),
    (
        "other-model",
        lambda d: _checkpoint(d, config={"model": "mlp"}, data_spec={"input_shape": [32], "num_classes": 10}),
        "was made for model mlp on inputs (32,) with 10 classes; this run is model cnn on inputs (3, 32, 32)",
    ),
    ("epochs-done", lambda d: _checkpoint(d, epoch=5), "has already trained 5 epochs; ask for more --epochs"),
    (
        "other-shapes",  # the same model name and data, but the model's code changed since
        lambda d: _checkpoint(d, model=_cnn_state(drop="head.bias", **{"head.weight": (10, 512)})),
        "holds another model than this run's (head.weight is [10, 512] there, [10, 1024] here; it lacks "
        "head.bias); give it a checkpoint of this model",
    ),
]


def _cnn_state(drop: str, **shapes: tuple[int, ...]) -> dict:
    """The built-in cnn's weights (3x32x32 inputs, 10 classes), some of other `shapes`, less `drop`."""
    import torch

    from raytrain_ddp.models import SmallCNN

    state = {name: torch.zeros(shapes.get(name, value.shape)) for name, value in SmallCNN(3, 10).state_dict().items()}
    del state[drop]
    return state


@pytest.mark.parametrize("make, message", [c[1:] for c in RESUME_FROM_CASES], ids=[c[0] for c in RESUME_FROM_CASES])
def test_bad_resume_from_is_one_line_and_exit_2(tmp_path, capsys, make, message):
    checkpoint = make(tmp_path / "checkpoint_x")
    code, stderr = cli_main(
        ["--storage-path", str(tmp_path / "runs"), "--epochs", "3", "--resume-from", checkpoint], capsys
    )
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --resume-from '{checkpoint}' ") and message in lines[0], (
        lines
    )
    assert not any((tmp_path / "runs").iterdir())


def test_unreadable_config_file(tmp_path):
    result = run_cli("raytrain_ddp.run", "--config", str(tmp_path / "missing.toml"), timeout=60)
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"error: --config '{tmp_path / 'missing.toml'}' cannot be read: No such file or directory"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("num_workers = [", "is not valid TOML"),
        ("num_wrokers = 2\n", "unknown key 'num_wrokers'"),
        ('num_workers = "two"\n', "num_workers must be int, got 'two'"),
        ("num_workers = 0\n", "--num-workers must be at least 1, got 0"),
    ],
    ids=["syntax", "unknown-key", "wrong-type", "bad-value"],
)
def test_bad_config_file(tmp_path, text, message):
    config = _write(tmp_path / "run.toml", text)
    result = run_cli("raytrain_ddp.run", "--config", config, "--storage-path", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


def test_unwritable_storage_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_cli("raytrain_ddp.run", "--storage-path", str(blocker / "runs"), timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: --storage-path '{blocker / 'runs'}' is not writable")


def test_flags_override_config_file(tmp_path):
    from raytrain_ddp.run import config_from_args

    config = _write(tmp_path / "run.toml", 'epochs = 7\nbatch_size = 32\nmodel = "mlp"\n')
    resolved = config_from_args(["--config", config, "--epochs", "3"])
    assert (resolved.epochs, resolved.batch_size, resolved.model) == (3, 32, "mlp")


def test_saved_config_reads_back_identically(tmp_path):
    from raytrain_ddp.config import TrainConfig, load_toml, to_toml

    original = TrainConfig(num_workers=3, lr=0.2, name="x", storage_path=str(tmp_path), data="/d/s")
    saved = _write(tmp_path / "config.toml", to_toml(original))
    assert TrainConfig(**load_toml(saved)) == original


def test_help_lists_every_flag_with_examples():
    result = run_cli("raytrain_ddp.run", "--help", timeout=60)
    assert result.returncode == 0
    for flag in (
        "--num-workers",
        "--use-gpu",
        "--cpus-per-worker",
        "--model",
        "--dataset",
        "--epochs",
        "--batch-size",
        "--lr",
        "--optimizer",
        "--seed",
        "--storage-path",
        "--name",
        "--num-to-keep",
        "--config",
        "--address",
    ):
        assert flag in result.stdout
    assert "examples:" in result.stdout and "global batch" in result.stdout


def test_console_script_is_the_same_cli():
    """pyproject's `raytrain-ddp` is raytrain_ddp.cli:main, which `python -m raytrain_ddp` runs: run that for real."""
    import tomllib
    from pathlib import Path

    from raytrain_ddp import cli

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    module, _, function = pyproject["project"]["scripts"]["raytrain-ddp"].partition(":")
    assert (module, function) == (cli.__name__, cli.main.__name__)
    result = run_cli("raytrain_ddp", "train", "--num-workers", "0", timeout=60)
    assert result.returncode == 2 and result.stderr == "error: --num-workers must be at least 1, got 0\n"


def command_main(args: list[str], capsys) -> tuple[int, str, str]:
    """`raytrain-ddp ARGS` in this process: (exit code, stdout, stderr); signal handlers put back as cli_main."""
    import signal

    from raytrain_ddp import cli
    from raytrain_ddp.driver.signals import STOP_SIGNALS

    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        code = cli.main(args)
    except SystemExit as exit_:  # argparse's --help and usage errors
        code = exit_.code
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_command_help_names_every_command(capsys):
    from raytrain_ddp.cli import COMMANDS

    code, out, _ = command_main(["--help"], capsys)
    assert code == 0 and out.startswith("usage: raytrain-ddp COMMAND")
    assert all(f"\n  {name}  " in out and f"raytrain-ddp {name} " in out for name in COMMANDS)


@pytest.mark.parametrize(
    "command, flags",
    [
        ("train", ["--num-workers", "--config", "--use-gpu", "--storage-path"]),
        ("launch", ["SCRIPT.py", "--num-workers", "--max-restarts", "--tee", "--hang-timeout-s", "exit codes"]),
        ("prepare", ["--from", "--out", "--val-fraction", "--label-column"]),
        ("inspect", ["path"]),
        ("evaluate", ["checkpoint", "--device", "--json"]),
        ("checkpoint", ["consolidate"]),
        ("report", ["RUN_DIR", "--verbose"]),
        ("status", ["--address"]),
        ("slurm", ["TRAINER FLAGS", "sbatch"]),
    ],
)
def test_every_command_has_help_with_its_flags_and_an_example(capsys, command, flags):
    from raytrain_ddp.cli import COMMANDS

    assert command in COMMANDS
    code, out, err = command_main([command, "--help"], capsys)
    assert code == 0 and not err
    assert out.startswith(f"usage: raytrain-ddp {command} ") and f"\n  raytrain-ddp {command} " in out, out
    assert "example" in out and all(flag in out for flag in flags), out


@pytest.mark.parametrize(
    "args, what", [([], "no command given"), (["trian"], "unknown command 'trian'"), (["--num-workers", "2"], "'--")]
)
def test_command_without_a_known_command_is_one_line_naming_them(capsys, args, what):
    code, out, err = command_main(args, capsys)
    assert code == 2 and not out and err.count("\n") == 1
    assert err.startswith("error: ") and what in err
    assert "choose one of: train, launch, prepare, inspect, evaluate, checkpoint, report, status, slurm" in err


@pytest.mark.parametrize("args", [["--num-workers", "0"], ["--num-gpus", "2"], ["--epochs", "three"]])
def test_train_command_errors_are_the_run_modules(tmp_path, capsys, args):
    argv = ["--storage-path", str(tmp_path / "runs"), *args]
    code, _, err = command_main(["train", *argv], capsys)
    assert (code, err) == cli_main(argv, capsys) and code == 2 and err.count("\n") == 1


@pytest.mark.parametrize(
    "model,dataset,output_shape",
    [
        ("cnn", "synthetic", (2, 10)),
        ("resnet18", "synthetic", (2, 10)),
        ("mlp", "synthetic-tabular", (2, 10)),
        ("transformer", "synthetic-tokens", (2, 32, 64)),
    ],
)
def test_every_builtin_model_builds_and_runs(model, dataset, output_shape):
    import torch

    from raytrain_ddp import TrainConfig
    from raytrain_ddp.data.spec import synthetic_spec
    from raytrain_ddp.models import build_model

    config = TrainConfig(model=model, dataset=dataset)
    spec = synthetic_spec(config)
    dtype = torch.long if spec.kind == "tokens" else torch.float32
    outputs = build_model(config, spec)(torch.zeros(2, *spec.input_shape, dtype=dtype))
    assert outputs.shape == output_shape


# Flags whose bad values are tested beside the code that reads them, not in the table above.
TESTED_ELSEWHERE = {
    "--image-column": "tests/test_data_validate.py",
    "--label-column": "tests/test_data_train.py",
    "--feature-columns": "tests/test_data_train.py",
    "--storage-path": "test_unwritable_storage_path",
    "--config": "test_bad_config_file",
}


def test_the_bad_input_table_covers_every_flag():
    from dataclasses import fields

    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.run import build_parser

    flags = {
        option
        for action in build_parser()._actions
        for option in action.option_strings
        if option.startswith("--") and not option.startswith("--no-") and option != "--help"
    }
    tested = {arg.split("=")[0] for case in CASES + NUMERIC_CASES for arg in case[1] if arg.startswith("--")}
    booleans = {
        "--use-gpu",
        "--compile",
        "--channels-last",
        "--scale-lr",
        "--skip-nonfinite",
        "--record-sample-ids",
        "--tensorboard",
        "--report",
        "--verbose",
        "--tf32",
    }  # one table row shows how any of them fails
    assert flags - tested - set(TESTED_ELSEWHERE) - booleans == set()
    limited = {f.name for f in fields(TrainConfig) if "maximum" in f.metadata}
    numeric = {f for f in flags if f[2:].replace("-", "_") in limited}
    assert numeric == {
        flag for flag in flags if any(c[0].startswith(flag[2:].replace("-", "_") + "-huge") for c in NUMERIC_CASES)
    }


def test_more_cpu_workers_than_cores_is_one_warning(caplog):
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.driver.preflight import check_local_capacity
    from raytrain_ddp.errors import plural

    cores = os.cpu_count()
    with caplog.at_level("WARNING", logger="raytrain_ddp"):
        check_local_capacity(TrainConfig(num_workers=cores + 1))
        check_local_capacity(TrainConfig(num_workers=cores))
    assert [r.getMessage() for r in caplog.records] == [
        f"{cores + 1} CPU workers x 1 CPU on {plural(cores, 'core')}: they share the cores and train slower than "
        f"{cores} would"
    ]


def test_data_cli_refuses_abbreviated_flags(tmp_path):
    result = run_cli(
        "raytrain_ddp.data",
        "prepare",
        "--fr",
        "csv",
        str(tmp_path / "t.csv"),
        "--out",
        str(tmp_path / "ds"),
        timeout=60,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--fr" in result.stderr and not (tmp_path / "ds").exists()


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda d: _write(d / "notes.txt", "hello"),
            "is not a checkpoint: give a checkpoint directory or its checkpoint.pt",
        ),
        (lambda d: _garbage(d / "ck") + "/checkpoint.pt", "is not a usable checkpoint: it does not load"),
        (lambda d: str((d / "empty").mkdir() or d / "empty"), "is not a usable checkpoint: checkpoint.pt is missing"),
        (lambda d: _checkpoint(d / "ck", drop=("model",)), "is not a usable checkpoint: keys missing: model"),
    ],
    ids=["text-file", "garbage", "empty-dir", "keys-missing"],
)
def test_evaluate_refuses_what_is_not_a_checkpoint(tmp_path, make, message):
    path = make(tmp_path)
    result = run_cli("raytrain_ddp.evaluate", path, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {path!r} ") and message in lines[0], lines


def test_default_run_names_are_utc_and_never_collide(tmp_path):
    import re

    from raytrain_ddp.config import TrainConfig

    names = {TrainConfig(storage_path=str(tmp_path)).validate().name for _ in range(50)}
    assert len(names) == 50
    assert all(re.fullmatch(r"run-\d{8}-\d{6}-\d{3}Z-[0-9a-f]{4}", name) for name in names), names
