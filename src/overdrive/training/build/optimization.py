"""Parameter groups (the weight-decay rule every optimizer follows) and the learning-rate schedule.

The schedule is counted in optimizer steps (not micro-batches, not per process), which is
why the loop steps it itself instead of handing it to `accelerator.prepare`. `constant`,
`linear` and `cosine` are overdrive's own (`lr_factor`); `wsd`, `polynomial`, `inverse_sqrt`
and `cosine_with_restarts` are Transformers' schedule functions, with `min_lr_ratio` applied
to them as each one's docstring in `transformers.optimization` allows. The optimizers
themselves are built in optimizers.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


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


OWN_SCHEDULES = ("constant", "linear", "cosine")


def _transformers_schedule(optimizer, s, max_steps: int):
    """One of Transformers' schedules (a LambdaLR), by `scheduler.name`."""
    from transformers import optimization as hf

    warmup = s.warmup_steps
    if s.name == "wsd":
        decay = max(1, round(s.decay_fraction * max(0, max_steps - warmup)))
        return hf.get_wsd_schedule(optimizer, num_warmup_steps=warmup, num_decay_steps=decay,
                                   num_training_steps=max_steps, decay_type=s.decay_type, min_lr_ratio=s.min_lr_ratio)
    if s.name == "polynomial":
        # lr_end is absolute and must stay below the initial lr; 1e-12 of it stands in for 1.0.
        peak = optimizer.defaults["lr"]
        return hf.get_polynomial_decay_schedule_with_warmup(
            optimizer, warmup, max_steps, lr_end=peak * min(s.min_lr_ratio, 1 - 1e-12), power=s.power)
    if s.name == "inverse_sqrt":
        schedule = hf.get_inverse_sqrt_schedule(optimizer, num_warmup_steps=warmup)
        return _floored(schedule, warmup, s.min_lr_ratio, rescale=False)
    schedule = hf.get_cosine_with_hard_restarts_schedule_with_warmup(optimizer, warmup, max_steps, s.num_cycles)
    return _floored(schedule, warmup, s.min_lr_ratio, rescale=True)


def _floored(schedule, warmup: int, floor: float, rescale: bool):
    """`min_lr_ratio` for a Transformers schedule that decays to 0: after warm-up the factor f
    becomes floor + (1 - floor) f (rescale), or max(floor, f)."""
    inner = schedule.lr_lambdas[0]

    def factor(step: int) -> float:
        f = inner(step)
        if step < warmup:
            return f
        return floor + (1.0 - floor) * f if rescale else max(floor, f)

    schedule.lr_lambdas = [factor] * len(schedule.lr_lambdas)
    # LambdaLR set each group's lr from the old factor at construction: set it again from the new one.
    for group, base in zip(schedule.optimizer.param_groups, schedule.base_lrs):
        group["lr"] = base * factor(0)
    schedule._last_lr = [group["lr"] for group in schedule.optimizer.param_groups]
    return schedule


def make_scheduler(optimizer, name: str, warmup_steps: int, max_steps: int, min_lr_ratio: float, scheduler=None):
    """A LambdaLR stepped once per optimizer step by the loop itself.

    It is deliberately not passed to `accelerator.prepare`: Accelerate's wrapper steps the
    schedule once per process per call (it assumes schedules counted in per-process batches).
    `scheduler` (the `scheduler` section) carries the settings of Transformers' schedules.
    """
    if name not in OWN_SCHEDULES:
        return _transformers_schedule(optimizer, scheduler, max_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, name, warmup_steps, max_steps, min_lr_ratio))


def lr_curve(cfg: RunConfig, points: int = 0) -> list[tuple[int, float]]:
    """(optimizer step, lr) at the schedule's key points: the start, the end of warm-up, where
    the decay starts and ends (wsd), each restart, the middle and the last step; with
    `points`, that many evenly spaced steps instead (a plot). Built with the run's own
    schedule on a stand-in parameter, so the curve is the one the loop will follow."""
    s, steps = cfg.scheduler, cfg.training.max_steps
    stand_in = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.lr)
    schedule = make_scheduler(stand_in, s.name, s.warmup_steps, steps, s.min_lr_ratio, s)
    factor = schedule.lr_lambdas[0]
    if points:
        at = sorted({round(i * (steps - 1) / max(1, points - 1)) for i in range(points)})
    else:
        at = {0, max(0, s.warmup_steps - 1), min(steps - 1, s.warmup_steps), (steps - 1) // 2, steps - 1}
        if s.name == "wsd":
            decay = max(1, round(s.decay_fraction * max(0, steps - s.warmup_steps)))
            at |= {max(0, steps - decay - 1), steps - decay}
        if s.name == "cosine_with_restarts":
            span = max(1, steps - s.warmup_steps)
            restarts = {s.warmup_steps + math.ceil(i * span / s.num_cycles) for i in range(1, s.num_cycles)}
            at |= restarts | {step - 1 for step in restarts}  # the bottom of each cycle and the restart
        at = sorted(step for step in at if 0 <= step < steps)
    return [(step, cfg.optim.lr * factor(step)) for step in at]
