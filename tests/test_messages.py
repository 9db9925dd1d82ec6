"""What the console says is true: counts agree with their nouns, and a resume names the epoch it resumes in."""

from __future__ import annotations

from raytrain_ddp.driver.run_checkpoints import describe
from raytrain_ddp.errors import plural
from raytrain_ddp.worker.checkpoint import Position


def test_a_count_agrees_with_its_noun():
    assert [plural(n, "worker") for n in (0, 1, 2)] == ["0 workers", "1 worker", "2 workers"]


def test_a_resume_names_the_epoch_it_resumes_in_and_what_of_it_is_done():
    """A checkpoint records the epochs done (2) and the optimizer steps done in the next: the run resumes in
    epoch 3, never "epoch 2"."""
    assert describe("runs/x/checkpoint_1", {"epoch": 2, "step_in_epoch": 24}) == (
        "runs/x/checkpoint_1, in epoch 3, 24 optimizer steps into it"
    )
    assert describe("runs/x/checkpoint_1", {"epoch": 2}) == "runs/x/checkpoint_1, at the start of epoch 3"
    assert Position(epoch=0, step_in_epoch=1).resumes() == "in epoch 1, 1 optimizer step into it"
