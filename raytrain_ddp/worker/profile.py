"""--profile-steps A:B: a torch.profiler trace of optimizer steps A to B on every rank, in RUN_DIR/profile/.

Each rank writes ``rank-N.trace.json`` (Chrome trace format: open it in
https://ui.perfetto.dev or chrome://tracing) and ``rank-N.top_ops.json``, its
operators by self time, which the report shows without reading the traces
(nor importing torch: this module imports it only where a profile is taken).
Ranks write straight into the run directory, as they do sample_ids/: on a
cluster it is shared storage; on object storage each rank writes its files in a
directory of its own and uploads them. No profiler exists outside the window: it starts
when step A's first micro-batch begins and stops after step B's optimizer step
(or when the run's loop ends first).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_ddp.errors import storage_full_as
from raytrain_ddp.files import write_atomic
from raytrain_ddp.storage import RunPath

if TYPE_CHECKING:
    import torch

log = logging.getLogger("raytrain_ddp.worker")

PROFILE_DIR = "profile"
TOP_OPS = 25  # rows per rank in top_ops.json
TOP_OPS_GLOB = "rank-*.top_ops.json"


def trace_path(run_dir: Path, rank: int) -> Path:
    return run_dir / PROFILE_DIR / f"rank-{rank}.trace.json"


def top_ops_path(run_dir: Path, rank: int) -> Path:
    return run_dir / PROFILE_DIR / f"rank-{rank}.top_ops.json"


class StepProfile:
    """One rank's profile window. The loop tells it where it is; outside the window each call is a comparison."""

    def __init__(
        self, window: tuple[int, int] | None, run_dir: RunPath | None, rank: int, device: torch.device
    ) -> None:
        self.window, self.run_dir, self.rank, self.device = window, run_dir, rank, device
        self.profiler: Any = None  # torch.profiler.profile while recording
        self.marker: Any = None  # the open "optimizer step N" range in the trace
        self.first_step = 0
        self.last_step = 0
        self.staging: Path | None = None  # this rank's local directory when the run directory is on object storage

    def step_begins(self, step: int) -> None:
        """A micro-batch of optimizer step `step` is about to run."""
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            return
        if self.profiler is None:
            self._start(step)
        if self.marker is None:
            import torch.profiler

            self.marker = torch.profiler.record_function(f"optimizer step {step}")
            self.marker.__enter__()

    def step_ended(self, step: int) -> None:
        """Optimizer step `step` was launched."""
        if self.profiler is None:
            return
        self.marker.__exit__(None, None, None)
        self.marker, self.last_step = None, step
        if step >= self.window[1]:
            self.close()

    def close(self) -> None:
        """Stop recording, if it is, and write this rank's files (also for a window the run ended inside)."""
        if self.profiler is None:
            return
        if self.marker is not None:
            self.marker.__exit__(None, None, None)
            self.marker = None
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        with storage_full_as(f"the profile of steps {self.first_step}-{self.last_step}", self.run_dir):
            self._write(profiler)

    def _write(self, profiler) -> None:
        run_dir = self._local_run_dir()
        assert self.run_dir is not None  # given whenever a window is
        trace = trace_path(run_dir, self.rank)
        partial = trace.with_name(f".{trace.name}.{os.getpid()}.tmp")  # whole or not at all, as write_atomic
        profiler.export_chrome_trace(str(partial))
        os.replace(partial, trace)
        table = {
            "rank": self.rank,
            "device": str(self.device),
            "steps": [self.first_step, self.last_step],
            "ops": top_ops(profiler.key_averages(), on_gpu=self.device.type == "cuda"),
        }
        write_atomic(top_ops_path(run_dir, self.rank), json.dumps(table, indent=1) + "\n")
        if run_dir != self.run_dir:  # object storage: one object per file, written whole
            for written in (trace, top_ops_path(run_dir, self.rank)):
                write_atomic(self.run_dir / PROFILE_DIR / written.name, written.read_bytes())
            shutil.rmtree(run_dir, ignore_errors=True)
            self.staging = None
        where = self.run_dir / PROFILE_DIR / trace.name
        log.info("profile of optimizer steps %d-%d written to %s", self.first_step, self.last_step, where)

    def _start(self, step: int) -> None:
        import torch.profiler

        (self._local_run_dir() / PROFILE_DIR).mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()
        self.first_step = step

    def _local_run_dir(self) -> Path:
        """Where torch.profiler writes: the run directory, or on object storage a directory of this rank's."""
        assert self.run_dir is not None  # given whenever a window is
        if isinstance(self.run_dir, Path):
            return self.run_dir
        if self.staging is None:
            self.staging = Path(tempfile.mkdtemp(prefix="raytrain-profile-"))
        return self.staging

    def __enter__(self) -> StepProfile:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:  # a failing rank leaves no profile: the process is going away
            self.close()


def top_ops(averages, on_gpu: bool) -> list[dict]:
    """The operators that took most self time (device time on a GPU), step markers left out; times in us."""
    rows = [
        {
            "name": event.key,
            "calls": event.count,
            "self_cpu_us": round(event.self_cpu_time_total, 1),
            "cpu_total_us": round(event.cpu_time_total, 1),
            **({"self_device_us": round(event.self_device_time_total, 1)} if on_gpu else {}),
        }
        for event in averages
        if not event.is_user_annotation
    ]
    rows.sort(key=lambda row: row["self_device_us" if on_gpu else "self_cpu_us"], reverse=True)
    return rows[:TOP_OPS]
