"""`RunSummary`: what RUN_DIR/summary.json says of a run, the contract between the driver that writes it and the
readers that act on it (the Slurm launcher requeues or resumes a job by it, the report shows it, a run that
continues checks it). Imports neither torch nor Ray: the launcher reads it before either is up.

The file stays plain JSON: `to_json` writes the keys it always had, `from_json` reads files of older and newer
versions alike (a key it does not know is kept and written back; a key the file lacks reads as None and is not
written back unless set).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Field metadata: a key written only once it holds a value (the file of a run without one has no such key)
WRITTEN_WHEN_SET = {"written": "when set"}


@dataclass
class RunSummary:
    status: str | None = None  # "finished", "stopped", "interrupted" or "failed"
    error: str | None = None
    stop_reason: str | None = None
    resume_checkpoint: str | None = None
    name: str | None = None
    run_dir: str | None = None
    epochs_completed: int | None = None
    epochs_requested: int | None = None
    world_size: int | None = None  # of the last attempt: elastic runs (--min-workers) may shrink
    per_worker_batch_size: int | None = None
    global_batch_size: int | None = None
    workers: list[dict] | None = None
    restarts: int | None = None
    hangs: list[str] | None = None
    stuck_nodes: list[str] | None = None
    lost_nodes: list[dict] | None = None
    final_metrics: dict | None = None
    best_checkpoint: str | None = None
    best_metrics: dict | None = None
    checkpoints_ranked_by: str | None = None
    latest_checkpoint: str | None = None
    samples_per_second: float | None = None
    model_tflops_per_second: float | None = None
    mfu: float | None = None
    param_checksums: list[str | None] | None = None
    replicas_identical: bool | None = None
    seconds: float | None = None
    launched: dict | None = field(default=None, metadata=WRITTEN_WHEN_SET)  # a user's script or function
    storage_full: dict | None = None  # StorageFull.record() of the write a full storage refused
    gpu_failed_nodes: list[str] | None = field(default=None, metadata=WRITTEN_WHEN_SET)  # failed before start
    other: dict[str, Any] = field(default_factory=dict)  # keys this version does not know, kept as read
    # known keys the file read did not hold: not written back until set (with_fields)
    absent: frozenset[str] = field(default_factory=frozenset, compare=False, repr=False)

    @classmethod
    def missing(cls) -> RunSummary:
        """The summary of a run that has written none: every key absent."""
        return cls.from_json({})

    @classmethod
    def from_json(cls, data: object) -> RunSummary:
        """The summary a parsed summary.json holds; ValueError when it is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("epochs_completed", 0), (int, type(None))):
            raise ValueError("not a run summary")
        known = {f.name for f in _keys()}
        return cls(
            **{key: value for key, value in data.items() if key in known},
            other={key: value for key, value in data.items() if key not in known},
            absent=frozenset(known - data.keys()),
        )

    def to_json(self) -> dict[str, Any]:
        """The dict summary.json holds."""
        written = {
            f.name: getattr(self, f.name)
            for f in _keys()
            if f.name not in self.absent and not (f.metadata == WRITTEN_WHEN_SET and getattr(self, f.name) is None)
        }
        return {**written, **self.other}

    def with_fields(self, **changes: Any) -> RunSummary:
        """A copy with `changes`, each written whether or not the file it was read from held it."""
        return dataclasses.replace(self, **changes, absent=self.absent - changes.keys())


def _keys() -> list[dataclasses.Field]:
    """The fields that are summary.json keys (not the bookkeeping of what was read)."""
    return [f for f in dataclasses.fields(RunSummary) if f.name not in ("other", "absent")]
