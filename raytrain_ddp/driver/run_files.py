"""The run directory's record of epochs: ``metrics.jsonl``, one aggregated record per line."""

from __future__ import annotations

import json
from pathlib import Path

from raytrain_ddp.files import write_atomic


class MetricsFile:
    """RUN_DIR/metrics.jsonl: read once when a run resumes, rewritten whole after every epoch."""

    def __init__(self, run_dir: Path) -> None:
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
