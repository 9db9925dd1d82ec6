"""RunSummary: summary.json's keys as one type, read from files of any version and written back unchanged."""

from __future__ import annotations

import pytest

from raytrain_ddp.summary import RunSummary


def test_a_summary_file_reads_and_writes_back_unchanged_with_keys_it_does_not_know():
    written = {"status": "stopped", "epochs_completed": 2, "stop_reason": "SIGUSR1", "from_a_newer_version": [1]}
    summary = RunSummary.from_json(written)
    assert summary.status == "stopped" and summary.epochs_completed == 2 and summary.world_size is None
    assert summary.to_json() == written  # the keys it lacked are not written back as nulls
    changed = summary.with_fields(status="failed", error="lost node n2")
    assert changed.to_json() == {**written, "status": "failed", "error": "lost node n2"}


def test_a_new_summary_writes_every_key_but_those_written_only_when_set():
    keys = RunSummary(status="finished").to_json()
    assert keys["status"] == "finished" and keys["error"] is None and "storage_full" in keys
    assert "launched" not in keys and "gpu_failed_nodes" not in keys
    assert RunSummary(launched={"function": "f"}).to_json()["launched"] == {"function": "f"}
    assert RunSummary.missing().to_json() == {} and RunSummary.missing() == RunSummary()


@pytest.mark.parametrize("data", [[], "finished", {"epochs_completed": "2"}])
def test_what_is_not_a_summary_does_not_read_as_one(data):
    with pytest.raises(ValueError, match="not a run summary"):
        RunSummary.from_json(data)
