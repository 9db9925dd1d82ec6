"""Stacks taken from outside: where a launched script's ranks are when the watchdog finds them all silent.

A hang in code the project did not write has no heartbeat phase to say where it is. `py-spy dump` (a
dependency) reads a process's Python stack without stopping or changing it; each rank's is taken on its own
node, and the rank whose main thread is not waiting inside torch.distributed (or inside backward, where DDP's
all-reduce runs) is the one the others wait for.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

DUMP_TIMEOUT_S = 20
TOP_FRAMES = 5
# Frames of a rank that waits for the others: a collective, or DDP's all-reduce inside backward
WAITING_IN = re.compile(r"\((?:[^()]*/)?torch/(?:distributed/|autograd/|_tensor\.py|nn/parallel/distributed\.py)")
THREAD_LINE = re.compile(r"^Thread (\d+)")
LAUNCHER_FRAMES = re.compile(r"<frozen runpy>|script_runner\.py:")  # how raytrain-ddp launch starts a script


@ray.remote(num_cpus=0)
def _dump(pid: int) -> str:
    """`py-spy dump` of a process on this node: its stack as text, or one line saying why there is none."""
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(py_spy):
        return "no stack: py-spy is not installed on this node (pip install py-spy)"
    done = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=DUMP_TIMEOUT_S)
    if done.returncode != 0:
        return f"no stack: py-spy could not read pid {pid}: {(done.stderr or done.stdout).strip()[:200]}"
    return done.stdout


def take(workers: dict[int, dict]) -> dict[int, str]:
    """Each rank's stack (`workers`: rank -> its facts, with `stack_pid` and `node_id`), taken on its node."""
    pending = {
        rank: _dump.options(scheduling_strategy=NodeAffinitySchedulingStrategy(info["node_id"], soft=False)).remote(
            info["stack_pid"]
        )
        for rank, info in workers.items()
        if info.get("stack_pid")
    }
    stacks = {}
    for rank, ref in pending.items():
        try:
            stacks[rank] = ray.get(ref, timeout=DUMP_TIMEOUT_S + 10)
        except Exception as err:  # a node that does not answer: its rank is not named from its stack
            stacks[rank] = f"no stack: {type(err).__name__}"
    return stacks


def main_thread(stack: str, pid: int) -> list[str]:
    """The frames (innermost first) of the thread whose id is the process's: its main thread."""
    frames: list[str] = []
    current = None
    for line in stack.splitlines():
        if match := THREAD_LINE.match(line):
            current = int(match.group(1))
        elif current == pid and line.startswith("    ") and not LAUNCHER_FRAMES.search(line):
            frames.append(line.strip())
    return frames


def outside_collectives(stacks: dict[int, str], workers: dict[int, dict]) -> dict[int, list[str]]:
    """The ranks whose main thread is not waiting in a collective, with its frames: the ones the others wait for."""
    found = {}
    for rank, stack in stacks.items():
        frames = main_thread(stack, workers[rank]["stack_pid"])
        if frames and not any(WAITING_IN.search(frame) for frame in frames):
            found[rank] = frames
    return found
