"""Model FLOPs per training sample, and the device's peak, for achieved TFLOP/s and MFU.

The count is made once per rank at start, with PyTorch's ``FlopCounterMode`` on
one forward of a one-row batch in eval mode, times 3: a backward costs twice a
forward, the usual convention of MFU (PaLM, nanoGPT). The forward runs on meta
tensors (``torch.func.functional_call`` with the weights' shapes, not their
values): no arithmetic is done, however large the model, nothing of it changes
(no BatchNorm statistics, no gradients), and attention is counted, which the
CPU's fused attention kernel hides from the counter (GPU kernels are counted).
A model that cannot run on meta tensors (a plug-in whose forward reads a
value, `.item()`, or makes tensors on the CPU) is counted with one real
forward of the row instead, in eval mode and without gradients.
MFU is model FLOPs per second over the device's dense bf16/fp16 peak: from
``--peak-tflops`` or the table below; on CPU, or a GPU not in the table,
there is no MFU unless the flag gives the peak. On CPU nothing is counted
unless the flag is given (the counter's first use costs seconds of imports).
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)

# Dense bf16/fp16 tensor-core peak, TFLOP/s, by a name torch.cuda.get_device_name() contains (first match).
PEAK_TFLOPS = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("A10G", 125.0),
    ("L4", 121.0),
    ("V100", 125.0),
)


def training_flops_per_sample(model: nn.Module, one_row: torch.Tensor) -> float | None:
    """3x one forward's FLOPs for `one_row` (a batch of one); None when the model cannot be counted."""
    was_training = model.training
    model.eval()
    shapes = {
        name: torch.empty_like(t, device="meta") for name, t in [*model.named_parameters(), *model.named_buffers()]
    }
    try:
        try:
            return 3.0 * _forward_flops(lambda: functional_call(model, shapes, (one_row.to("meta"),)))
        except Exception:  # a forward that needs values: count a real one
            return 3.0 * _forward_flops(lambda: model(one_row))
    except Exception as err:  # a plug-in model may refuse a dummy row; MFU is a nicety, never a failure
        log.warning("model FLOPs not counted (no MFU): %s: %s", type(err).__name__, err)
        return None
    finally:
        model.train(was_training)


def _forward_flops(forward) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        forward()
    return counter.get_total_flops()


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    """The device's peak dense TFLOP/s: `given` (--peak-tflops), else the table's for a known GPU, else None."""
    if given is not None:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)
