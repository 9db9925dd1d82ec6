"""The run directory's record of epochs: ``metrics.jsonl``, one aggregated record per line."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write, flush and fsync a temporary file, then rename it over `path`: a reader (or a crash) sees the old
    file or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    tmp.replace(path)


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
        write_atomically(self.path, "".join(json.dumps(epochs[e]) + "\n" for e in sorted(epochs)))
