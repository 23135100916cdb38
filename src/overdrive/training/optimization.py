"""AdamW and its learning-rate schedule, as the training loop uses them.

The schedule is counted in optimizer steps (not micro-batches, not per process), which is
why the loop steps it itself instead of handing it to `accelerator.prepare`.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def full_ndim(param: torch.Tensor) -> int:
    """Dimensions of the whole parameter. A ZeRO-3 parameter built under `zero.Init` is an
    empty placeholder (`dim()` 0) and keeps its real shape in `ds_shape` (DeepSpeed's
    partition_parameters.py); an FSDP2 DTensor already reports its global shape."""
    shape = getattr(param, "ds_shape", None)
    return len(shape) if shape is not None else param.dim()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices and embeddings; leave biases and norm scales (1-D tensors) alone."""
    params = [p for p in model.parameters() if p.requires_grad]  # an adapter run: the adapter's alone
    groups = [
        {"params": [p for p in params if full_ndim(p) >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if full_ndim(p) < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]  # LoRA has no 1-D tensors: no empty group for ZeRO to flatten


def adamw_kernel(implementation: str, device_type: str) -> dict[str, bool]:
    """AdamW keyword arguments choosing the kernel: one fused kernel beats a loop per tensor."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices, _get_fused_kernels_supported_devices

    if implementation == "auto":
        if device_type in _get_fused_kernels_supported_devices():
            implementation = "fused"
        elif device_type in _get_foreach_kernels_supported_devices():
            implementation = "foreach"
        else:
            implementation = "for-loop"
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


def make_optimizer(model, lr: float, weight_decay: float, betas, eps: float, implementation: str, device_type: str):
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas), eps=eps,
                             **adamw_kernel(implementation, device_type))


def lr_factor(step: int, name: str, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based).

    Warm-up rises linearly to 1 over `warmup_steps` (nanoGPT's (step+1)/(warmup+1): the
    first step already learns). Then: constant; linear to 0 at `max_steps`; or cosine to
    `min_lr_ratio`.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if name == "linear":
        return 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer, name: str, warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """A LambdaLR stepped once per optimizer step by the loop itself.

    It is deliberately not passed to `accelerator.prepare`: Accelerate's wrapper steps the
    schedule once per process per call (it assumes schedules counted in per-process batches).
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, name, warmup_steps, max_steps, min_lr_ratio))
