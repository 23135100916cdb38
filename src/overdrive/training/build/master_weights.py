"""fp16 mixed precision keeps the trained weights in fp32.

torch's GradScaler refuses fp16 gradients ("Attempting to unscale FP16 gradients", at the first
clipped step): under fp16 autocast the weights that train must be fp32 (the master copy), their
matmuls cast to fp16 by autocast. A model loaded in fp16 (`model.dtype: float16`, or `auto` on
an fp16 checkpoint) has fp16 weights, so the trainable ones are upcast here, before the
optimizer sees them; frozen weights (an adapter run's base) stay as loaded.

DeepSpeed's fp16 engine keeps its own fp32 master copy, and FSDP2 upcasts trainable parameters
itself under mixed precision (Accelerate, except beside 4-bit weights): the upcast is harmless
there and needed everywhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


def upcast_trainable(cfg: RunConfig, model: Any) -> int:
    """Trainable fp16/bf16 parameters of an fp16 run made fp32; returns how many were."""
    import torch

    if cfg.precision.mixed_precision != "fp16":
        return 0
    from overdrive.strategies import registry

    if registry.of(cfg).engine_steps_optimizer:  # DeepSpeed: its engine casts and keeps fp32 masters
        return 0
    upcast = 0
    for param in model.parameters():
        if param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
            upcast += 1
    return upcast


def note(count: int) -> list[str]:
    return [f"precision.mixed_precision=fp16: {count} trainable tensors loaded in 16 bits are trained in fp32 "
            "(the loss scaler unscales fp32 gradients only; autocast still computes in fp16)"] if count else []
