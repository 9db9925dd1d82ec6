"""A training script in the shape of PyTorch's DDP tutorial (pytorch/examples, ddp-tutorial-series
multigpu_torchrun.py): it knows nothing of raytrain-ddp and runs the same under both launchers:

    torchrun --nproc-per-node 2 examples/ddp_tutorial.py 5 1 --snapshot /tmp/snapshot.pt
    raytrain-ddp launch --num-workers 2 examples/ddp_tutorial.py 5 1 --snapshot /tmp/snapshot.pt

Rank zero saves a snapshot every `save_every` epochs; a restarted run (torchrun --max-restarts, raytrain-ddp
launch --max-restarts, or the same command again) resumes from it. --out writes the final weights.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def ddp_setup() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo")
    return torch.device("cpu")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, device, pause_s=0.0):
        self.pause_s = pause_s
        self.global_rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        losses = [self._run_batch(x.to(self.device), y.to(self.device)) for x, y in self.train_data]
        print(f"[GPU{self.global_rank}] Epoch {epoch} | Steps: {len(losses)} | Loss {sum(losses) / len(losses):.4f}")

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,
        }
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)  # a kill mid-save leaves the last one whole
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)
            dist.barrier()  # the snapshot is whole before any rank goes on
            time.sleep(self.pause_s)  # a test's window to kill a rank between epochs


def load_train_objs(rows: int):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 20, generator=generator)
    y = (x[:, :5].sum(dim=1) > 0).long() + 2 * (x[:, 5:10].sum(dim=1) > 0).long()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return TensorDataset(x, y), model, optimizer


def main(save_every, total_epochs, batch_size, snapshot_path, rows, out, pause_s):
    device = ddp_setup()
    dataset, model, optimizer = load_train_objs(rows)
    train_data = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, device, pause_s)
    trainer.train(total_epochs)
    if out and int(os.environ["RANK"]) == 0:
        torch.save(trainer.model.module.state_dict(), out)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot", default="snapshot.pt", help="where rank zero saves its snapshot")
    parser.add_argument("--rows", default=2048, type=int, help="rows of the generated training set")
    parser.add_argument("--out", default=None, help="write the final weights here (rank zero)")
    parser.add_argument("--pause-s", default=0.0, type=float, help="sleep this long after each epoch")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot, args.rows, args.out, args.pause_s)
