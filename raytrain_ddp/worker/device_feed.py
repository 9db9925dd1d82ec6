"""Host batches onto the training device, on the training workers (the data pipeline itself never imports
torch: raytrain_ddp.data.pipeline makes the host batches)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

import torch

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.pipeline import TrainShard
from raytrain_ddp.data.spec import DataSpec


def normalise_images(pixels: torch.Tensor, spec: DataSpec) -> torch.Tensor:
    """uint8 NCHW pixels -> the model's float inputs: what to_model_inputs does, in torch (on any device)."""
    shift, scale = _normalisation(tuple(spec.mean), tuple(spec.std), pixels.device)
    return (pixels.to(torch.float32) / 255.0 - shift) / scale


@functools.cache
def _normalisation(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The constants, made once per device: a torch.tensor(..., device=cuda) is a copy the host waits for."""
    return tuple(
        torch.tensor(values, dtype=torch.float32, device=device).reshape(1, -1, 1, 1) for values in (mean, std)
    )


def padding_batch(spec: DataSpec, device) -> dict:
    """One all-zero row shaped and typed as the model's input: what a rank that has run out of validation
    batches runs, uncounted, while FSDP's forwards (collectives) keep every rank in lockstep."""
    dtype = getattr(torch, spec.input_dtype or ("int64" if spec.kind == "tokens" else "float32"))
    return {"x": torch.zeros((1, *spec.input_shape), dtype=dtype, device=device)}


def epoch_batches(shard: TrainShard, config: TrainConfig, epoch: int, device, earlier_parts=()) -> Iterator[dict]:
    """This rank's torch batches of `epoch` (counted from 1) on `device`: a function of (seed, epoch, rank,
    world size), and of the epoch's `earlier_parts` when it was begun at other world sizes."""
    feed = DeviceFeed(shard.source.spec, device)
    for batch in shard.host_batches(config, epoch, earlier_parts):
        yield feed.receive(feed.send(batch))


class DeviceFeed:
    """Host batches onto the training device with no host-device wait.

    `send` starts a batch's copy: pinned (page-locked) host memory and
    `non_blocking` copies, on a stream of their own, so the next batch travels
    while the current one computes; uint8 images are normalised there too, with
    constants made once per device. Ids stay on the host (only the loop's
    bookkeeping reads them). `receive` makes the compute stream wait (on the
    device, not the host) for that batch's copy. On CPU each of these is a
    no-op, on the same code path.
    """

    def __init__(self, spec: DataSpec | None, device) -> None:
        self.spec, self.device = spec, torch.device(device)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def send(self, batch: dict) -> tuple[dict, object]:
        """(the batch with its tensors on the device, still arriving; what `receive` waits for)."""
        stream = self._copy_stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            moved = {
                name: self._copy(values) if name != "id" and isinstance(values, torch.Tensor) else values
                for name, values in batch.items()
            }
            if "x" in moved and moved["x"].dtype == torch.uint8:  # images, normalised where the batch is used
                moved["x"] = normalise_images(moved["x"], self.spec)
            return moved, stream.record_event() if stream is not None else None

    def ahead(self, batches: Iterable[dict]) -> Iterator[tuple[dict, bool]]:
        """(device batch, is_last) pairs, each batch's copy started (and the next batch fetched) before the one
        before it is handed out to compute."""
        sent = None
        for batch in batches:
            following = self.send(batch)
            if sent is not None:
                yield self.receive(sent), False
            sent = following
        if sent is not None:
            yield self.receive(sent), True

    def receive(self, sent: tuple[dict, object]) -> dict:
        batch, copied = sent
        if copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)
            for values in batch.values():
                if isinstance(values, torch.Tensor) and values.device.type == "cuda":
                    values.record_stream(compute)  # memory made on the copy stream, freed after compute used it
        return batch

    def _copy(self, values: torch.Tensor) -> torch.Tensor:
        if self._copy_stream is not None:
            values = values.pin_memory()  # from PyTorch's caching host allocator: reused, not re-pinned
        return values.to(self.device, non_blocking=True)
