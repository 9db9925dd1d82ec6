"""The run directory's records: ``metrics.jsonl`` (one aggregated record per epoch) and ``steps.jsonl`` (one per
recorded optimizer step), a line each."""

from __future__ import annotations

import json
import time
from pathlib import Path

from raytrain_ddp.files import write_atomic
from raytrain_ddp.storage import RemotePath, RunPath


class MetricsFile:
    """RUN_DIR/metrics.jsonl: read once when a run resumes, rewritten whole after every epoch."""

    def __init__(self, run_dir: RunPath) -> None:
        self.path = run_dir / "metrics.jsonl"

    def read(self) -> dict[int, dict]:
        """A resumed run keeps the epochs it already recorded: epoch -> record."""
        if not self.path.exists():
            return {}
        records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return {r["epoch"]: r for r in records}

    def write(self, epochs: dict[int, dict]) -> None:
        """Every epoch's record in epoch order (an epoch re-run after a restart has replaced its record)."""
        write_atomic(self.path, "".join(json.dumps(epochs[e]) + "\n" for e in sorted(epochs)))


def write_rank_lists(run_dir: RunPath, name: str, lists: dict[str, list]) -> None:
    """A large world's per-rank lists of one epoch, in RUN_DIR/`name` (ranks/epoch-E.json): metrics.jsonl holds
    their summaries."""
    path = run_dir / name
    if not isinstance(path, RemotePath):
        path.parent.mkdir(exist_ok=True)
    write_atomic(path, json.dumps(lists))


class StepsFile:
    """RUN_DIR/steps.jsonl: appended to as each recorded step is in from every rank (a resumed run's kept).

    Object storage cannot append: there the whole file is rewritten, at most every REMOTE_WRITE_EVERY_S and at
    each :meth:`flush` (each epoch's end and the run's), not once per record (a long run's file would be
    uploaded whole thousands of times)."""

    REMOTE_WRITE_EVERY_S = 30.0

    def __init__(self, run_dir: RunPath) -> None:
        self.path = run_dir / "steps.jsonl"
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        self.records = [json.loads(line) for line in lines if line.strip()]
        self._unwritten = False  # records the file does not hold yet (object storage, or a failed write)
        self._written_at = time.monotonic()

    def add(self, record: dict) -> None:
        """A step at or before the last one recorded is trained again (after a restart or a resume from an
        earlier checkpoint): it and the steps after it are replaced."""
        replaced = bool(self.records) and record["step"] <= self.records[-1]["step"]
        if replaced:
            self.records = [r for r in self.records if r["step"] < record["step"]]
        self.records.append(record)
        if isinstance(self.path, RemotePath):
            self._unwritten = True
            if time.monotonic() - self._written_at >= self.REMOTE_WRITE_EVERY_S:
                self.flush()
        elif replaced or self._unwritten:
            self._write_whole()
        else:
            self._append(self.path, record)

    def _append(self, path: Path, record: dict) -> None:
        try:
            with path.open("a") as file:
                file.write(json.dumps(record) + "\n")
        except OSError:
            self._unwritten = True  # the line may be cut short (a full disk): the next write rewrites the file whole
            raise

    def flush(self) -> None:
        """Write what the file does not hold yet: on object storage, or after a write that failed."""
        if self._unwritten:
            self._write_whole()

    def _write_whole(self) -> None:
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        self._unwritten, self._written_at = False, time.monotonic()
