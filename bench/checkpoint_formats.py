"""Full vs sharded-async checkpoints of FSDP on 2 CPU ranks (gloo): how long training is blocked per
checkpoint, and rank zero's peak resident memory.

    python -m bench.checkpoint_formats                 # the built-in transformer at dim 768, depth 8 (~60 M)
    python -m bench.checkpoint_formats --depth 4 8                    # two sizes: what grows with the model
    python -m bench.checkpoint_formats --dim 256 --depth 2 --saves 2   # a quick look

Two processes per format run the project's own code (strategy.distribute, full_state + checkpoint.save on
rank zero; sharded_state + ShardedSaver) without Ray: Ray Train's report is left out of both (full: the
copy into the run directory comes on top). Between checkpoints each rank trains --steps AdamW steps, so a
sharded write has that long to finish before the next checkpoint waits for it. A third pair trains the same
steps without checkpoints (format "none"): the memory training takes by itself, so the peak each format adds
is told apart from training's own (whose peak also grows over the first steps).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import tempfile
import time
from pathlib import Path

VOCAB, LENGTH, BATCH = 256, 64, 4


def _checkpoint_once(fmt: str, rank: int, model, optimizer, saver, run_dir: Path) -> None:
    """One checkpoint in `fmt` ("none": the same training without one, for the memory it takes by itself)."""
    from raytrain_ddp.checkpoint.layout import new_checkpoint_name
    from raytrain_ddp.checkpoint.saver import save
    from raytrain_ddp.checkpoint.state import Position, plain_state
    from raytrain_ddp.worker import strategy

    training_state, run_info = {"scheduler": {}, "scaler": {}, "world_size": 2}, {"config": {}, "data_spec": {}}
    if fmt == "none":
        return
    if saver is not None:
        saver.save(*strategy.sharded_state(model, optimizer), plain_state(training_state, Position(), {}, run_info), {})
        return
    model_state, optimizer_state = strategy.full_state(model, optimizer)
    if rank == 0:
        directory = run_dir / new_checkpoint_name()
        directory.mkdir()
        save(str(directory), model_state, optimizer_state, training_state, Position(), {}, run_info)


def _rank(rank: int, fmt: str, args: dict, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from raytrain_ddp.checkpoint.saver import ShardedSaver
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.models import TransformerLM
    from raytrain_ddp.worker import strategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = TransformerLM(VOCAB, LENGTH, dim=args["dim"], depth=args["depth"], heads=8)
    parameters = sum(p.numel() for p in model.parameters())
    model, _ = strategy.distribute(model, TrainConfig(strategy="fsdp"), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run_dir = Path(args["dir"]) / fmt
    run_dir.mkdir(parents=True, exist_ok=True)
    saver = ShardedSaver(run_dir, rank, report=lambda metrics, directory: None) if fmt == "sharded" else None

    def train(steps: int) -> None:
        for _ in range(steps):
            model(torch.randint(0, VOCAB, (BATCH, LENGTH))).mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    train(1)
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss: KiB)
    blocked = []
    for _ in range(args["saves"]):
        dist.barrier()
        started = time.perf_counter()
        _checkpoint_once(fmt, rank, model, optimizer, saver, run_dir)
        blocked.append(time.perf_counter() - started)
        train(args["steps"])
    waited = time.perf_counter()
    if saver is not None:
        saver.flush()
    final_wait = time.perf_counter() - waited
    if rank == 0:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        figures = {"format": fmt, "parameters": parameters, "blocked_s": blocked, "final_wait_s": final_wait}
        Path(out).write_text(json.dumps({**figures, "rank0_rss_before_gib": baseline_rss, "rank0_peak_rss_gib": peak}))
    dist.barrier()
    dist.destroy_process_group()


# Each rank a fresh process (its peak RSS its own), forked from a server that imported these once: not 4-5 CPU
# seconds of imports per rank and format
RANK_IMPORTS = ["torch", "torch.distributed.checkpoint", "raytrain_ddp.models", "raytrain_ddp.checkpoint.saver"]


def measure(fmt: str, args: dict) -> dict:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_IMPORTS)
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as scratch:
        out = Path(scratch) / "result.json"
        ranks = [
            context.Process(target=_rank, args=(rank, fmt, {**args, "dir": scratch}, f"{scratch}/store", str(out)))
            for rank in (0, 1)
        ]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join()
            if process.exitcode != 0:
                raise SystemExit(f"{fmt}: a rank exited with {process.exitcode}")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--depth", type=int, nargs="+", default=[8], help="one size per depth (4 8: two sizes)")
    parser.add_argument("--saves", type=int, default=3, help="checkpoints per format")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps between checkpoints")
    parser.add_argument("--json", help="also write the results here")
    args = vars(parser.parse_args())
    results = {
        depth: {fmt: measure(fmt, {**args, "depth": depth}) for fmt in ("none", "full", "sharded")}
        for depth in args["depth"]
    }
    print("FSDP, 2 CPU ranks (gloo), the built-in transformer, AdamW; added: rank 0's peak RSS less the peak of the")
    print("same training without checkpoints (format none): what checkpointing takes")
    header = "| parameters | format | blocked per checkpoint (s, median) | final wait (s) | rank 0 peak RSS (GiB)"
    print(header + " | added (GiB) |")
    print("|---|---|---|---|---|---|")
    for by_format in results.values():
        for fmt, r in by_format.items():
            if fmt == "none":
                continue
            median = sorted(r["blocked_s"])[len(r["blocked_s"]) // 2]
            each = ", ".join(f"{b:.2f}" for b in r["blocked_s"])
            print(
                f"| {r['parameters'] / 1e6:.1f} M | {fmt} | {median:.2f} ({each}) "
                f"| {r['final_wait_s']:.2f} | {r['rank0_peak_rss_gib']:.2f} "
                f"| {r['rank0_peak_rss_gib'] - by_format['none']['rank0_peak_rss_gib']:.2f} |"
            )
    if args["json"]:
        Path(args["json"]).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
