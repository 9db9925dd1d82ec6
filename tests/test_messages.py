"""What the console says is true: counts agree with their nouns, and a resume names the epoch it resumes in."""

from __future__ import annotations

from raytrain_ddp.checkpoint.state import Position, describe
from raytrain_ddp.errors import named, plural


def test_a_count_agrees_with_its_noun():
    assert [plural(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]
    assert [named("rank", ranks) for ranks in ([1], [0, 3], [])] == ["rank 1", "ranks 0, 3", "no ranks"]


def test_a_resume_names_the_epoch_it_resumes_in_and_what_of_it_is_done():
    """A checkpoint records the epochs done (2) and the optimizer steps done in the next: the run resumes in
    epoch 3, never "epoch 2"."""
    assert describe("runs/x/checkpoint_1", {"epoch": 2, "step_in_epoch": 24}) == (
        "runs/x/checkpoint_1, in epoch 3, 24 optimizer steps into it"
    )
    assert describe("runs/x/checkpoint_1", {"epoch": 2}) == "runs/x/checkpoint_1, at the start of epoch 3"
    assert Position(epoch=0, step_in_epoch=1).resumes() == "in epoch 1, 1 optimizer step into it"


COUNTED_NOUNS = r"(workers|epochs|nodes|ranks|optimizer steps|steps|rows|CPUs|logical CPUs|cores|GPUs)"
ALWAYS_MANY = (  # counts these messages only show above 1
    'label=f"min..max over {ranks} ranks"',  # the spread is drawn for many ranks only
    "Only %d of the %d workers asked for",  # more were asked for than fit: at least 2
    "but this job spans %d nodes",  # said of a multi-node job only
    "asks for {last - first + 1} steps; at most",  # more than the most allowed
    'f"{DASH} workers"',  # no count: a dash
    "/{want} nodes joined",  # a fraction, "0/1 nodes"
    "init_process_group: the {supervisor.world_size} ranks",  # said of more than one rank only
    "over {_e(last.get('world_size'))} ranks",  # the report's large-world section: over PER_RANK_LIMIT ranks
)


def test_every_message_counts_through_plural():
    """'with 1 workers' is what a new user sees first: a count before a plural noun goes through plural()."""
    import re
    from pathlib import Path

    import raytrain_ddp

    pattern = re.compile(r"(%d|\{[^{}]*\}) " + COUNTED_NOUNS + r"\b")
    found = [
        f"{path.name}: {line.strip()}"
        for path in Path(raytrain_ddp.__file__).parent.rglob("*.py")
        for line in path.read_text().splitlines()
        if pattern.search(line) and not any(allowed in line for allowed in ALWAYS_MANY)
    ]
    assert found == [], found


def test_no_message_hedges_a_count_with_a_parenthesised_s():
    """'2 node(s)', 'requeued 1 time(s)': the count is known, so the noun can agree with it (plural())."""
    import re
    from pathlib import Path

    import raytrain_ddp

    pattern = re.compile(r"""(%d|%s|\{[^{}]*\}) [A-Za-z ]*\w\(s\)|\w\(s\) (%s|\{)""")
    found = [
        f"{path.name}: {line.strip()}"
        for path in Path(raytrain_ddp.__file__).parent.rglob("*.py")
        for line in path.read_text().splitlines()
        if pattern.search(line)
    ]
    assert found == [], found


def test_a_group_shrunk_to_one_worker_is_said_in_the_singular(tmp_path, caplog):
    from raytrain_ddp import TrainConfig
    from raytrain_ddp.driver.monitor import RunRecorder

    config = TrainConfig(num_workers=2, storage_path=str(tmp_path), name="unit")
    config.run_dir.mkdir(parents=True)
    recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=2, sinks=[])
    with caplog.at_level("WARNING", logger="raytrain_ddp"):
        recorder.consume([("started", 0, {"rank": 0, "world_size": 1, "hostname": "h", "node_id": "n"})])
    assert "Training goes on with 1 worker (was 2): global batch now" in caplog.text, caplog.text


def test_evaluate_of_a_mid_epoch_checkpoint_says_where_its_weights_are_and_that_none_was_recorded():
    """A mid-epoch checkpoint records a placeholder score (inf for val_loss) and nothing else: the line
    neither fails on the missing val_accuracy nor calls weights 24 steps into epoch 3 "epoch 2"."""
    from raytrain_ddp.evaluate import describe_result

    scored = {"epoch": 2, "val_accuracy": 0.5, "val_loss": 0.7, "val_rows": 1, "device": "cpu"}
    mid_epoch = {**scored, "recorded": {"epoch": 2, "step_in_epoch": 24, "val_loss": float("inf")}}
    assert describe_result(mid_epoch) == (
        "in epoch 3, 24 optimizer steps into it (a mid-epoch checkpoint, no validation recorded): "
        "val_accuracy 0.5000, val_loss 0.7000 over 1 row on cpu"
    )
    after_epoch = {**scored, "recorded": {"epoch": 2, "val_loss": 0.7, "val_accuracy": 0.5}}
    assert describe_result(after_epoch) == (
        "epoch 2: val_accuracy 0.5000 (recorded 0.5000), val_loss 0.7000 (recorded 0.7000) over 1 row on cpu"
    )


def test_a_resumed_run_says_how_many_epochs_its_seconds_trained():
    """'Finished 5 epochs in 12s' after resuming at epoch 4 overstates the speed by 2.5 times."""
    from raytrain_ddp.driver.console import finished_text

    assert finished_text(5, 5, 51.2) == "5 epochs in 51s"
    assert finished_text(1, 1, 9) == "1 epoch in 9s"
    assert finished_text(5, 2, 12.4) == "5 epochs (2 epochs trained in this run's 12s)"
