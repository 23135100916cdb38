"""`training.nonfinite_loss`: keep a NaN/inf step out of the weights, without a sync per step.

A non-finite loss makes non-finite gradients, and so a non-finite gradient norm (the norm
is taken over all ranks' gradients: every rank reaches the same verdict). The guard reads
that norm on the device:

- fused AdamW (the default on CPU and CUDA) accepts a `found_inf` tensor, the mechanism
  torch's GradScaler uses: when it is 1 the kernel leaves weights, moments and the step
  count untouched. Setting it is a device operation, so nothing waits for the device.
- other AdamW kernels cannot skip on the device: the norm is read on the host (one
  host-device sync per optimizer step) and `optimizer.step()` is not called.
- fp16 with a GradScaler: the scaler already skips steps whose gradients overflow, and
  shrinks the scale; those are counted as loss-scale overflows, not as bad losses.
- DeepSpeed fp16 with dynamic loss scaling (`parallel.deepspeed.loss_scale: 0`, the
  default): DeepSpeed skips an overflowing step and lowers the scale itself, and reports
  the gradient norm as inf then; Accelerate's `optimizer_step_was_skipped` reads its
  `overflow` flag. Those are loss-scale overflows (counted as such by the loop), normal
  early in training, not bad losses: the guard leaves them to DeepSpeed.
- DeepSpeed steps its own optimizer inside `backward`: a bad step cannot be undone from
  outside, so under DeepSpeed (bf16/fp32) non-finite steps are counted and the run stops
  after `training.max_nonfinite_in_a_row` of them, but they are not skipped.

Skipped steps still advance the schedule and the data (the loop cannot know without a
sync). Counters stay on the device and are read at logging steps, which sync anyway; so a
`stop` takes effect at the next logging step (the bad steps in between are skipped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch


def _inner(optimizer: Any) -> Any:
    while hasattr(optimizer, "optimizer"):  # AcceleratedOptimizer and friends
        optimizer = optimizer.optimizer
    return optimizer


@dataclass
class Counts:
    """What the guard saw since the last logging step."""

    skipped: int = 0  # steps with a non-finite norm (skipped, except under DeepSpeed)
    worst_run: int = 0  # the longest run of them in a row
    in_a_row: int = 0  # the run still going on
    scaler_skips: int = 0  # fp16: steps the loss scaler skipped (gradient overflow)

    def record(self) -> dict[str, int]:
        return {"nonfinite_skipped": self.skipped, "loss_scale_skips": self.scaler_skips}

    def note(self, step: int) -> str:
        if not self.scaler_skips:
            return ""
        return (f"step {step}: {self.scaler_skips} step(s) skipped by the fp16 loss scaler (gradient overflow; "
                "it lowered the scale), not a bad loss")

    def verdict(self, mode: str, limit: int, loss: float, step: int) -> str:
        """Why the run must stop now (empty: it goes on)."""
        return verdict(mode, limit, loss, self.skipped, self.worst_run, step)


class NonfiniteGuard:
    def __init__(self, mode: str, optimizer: Any, device: torch.device, scaler: Any = None,
                 deepspeed: bool = False, dynamic_loss_scale: bool = False):
        self.mode = mode
        inner = _inner(optimizer)
        # A loss scaler (torch's GradScaler, or DeepSpeed's with `dynamic_loss_scale`) owns overflows.
        self.active = mode != "ignore" and scaler is None and not dynamic_loss_scale
        self.can_skip = not deepspeed
        self.device_side = bool(getattr(inner, "defaults", {}).get("fused")) and self.can_skip
        self._optimizer = inner
        zeros = lambda: torch.zeros((), device=device)  # noqa: E731
        self.skipped, self.in_a_row, self.worst_run = zeros(), zeros(), zeros()
        self.scaler_skips = 0
        self._host_ok = True

    @property
    def needs_norm(self) -> bool:
        return self.active

    def check(self, grad_norm: Optional[Any]) -> None:
        """Called once per optimizer step, after gradients are final and before `step()`."""
        if not self.active or grad_norm is None:
            self._host_ok = True
            return
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        norm = torch.as_tensor(norm, device=self.skipped.device)
        bad = (~torch.isfinite(norm)).to(self.skipped.dtype)
        self.skipped += bad
        self.in_a_row.mul_(bad).add_(bad)  # reset by a good step, +1 by a bad one
        torch.maximum(self.worst_run, self.in_a_row, out=self.worst_run)
        if self.device_side:
            self._optimizer.found_inf = bad
            self._host_ok = True
        elif self.can_skip:
            self._host_ok = not bool(bad.item())  # the host-device sync of non-fused kernels
        else:
            self._host_ok = True

    def allows_step(self) -> bool:
        """False only on the host path, for a step to skip."""
        return self._host_ok

    def scaler_skipped(self) -> None:
        self.scaler_skips += 1

    def read(self) -> Counts:
        """The counts since the last read (a sync: call it at logging steps)."""
        values = torch.stack([self.skipped, self.worst_run, self.in_a_row]).tolist()
        counts = Counts(int(values[0]), int(values[1]), int(values[2]), self.scaler_skips)
        self.skipped.zero_()
        self.worst_run.copy_(self.in_a_row)
        self.scaler_skips = 0
        return counts

    def run_length(self) -> int:
        """Bad steps in a row right now (a sync; for checkpoints)."""
        return int(self.in_a_row.item())

    def restore(self, in_a_row: int) -> None:
        self.in_a_row.fill_(in_a_row)
        self.worst_run.fill_(in_a_row)


def verdict(mode: str, limit: int, loss: float, skipped: int, worst_run: int, step: int) -> str:
    """Why the run must stop now (empty: it goes on), from the counters read at a logging step."""
    if mode == "ignore":
        return ""
    bad = skipped > 0 or not math.isfinite(loss)
    if mode == "stop" and bad:
        return (f"non-finite loss or gradients at or before step {step} (training.nonfinite_loss=stop); "
                "that step was not applied")
    if worst_run >= limit:
        return (f"{worst_run} steps in a row with a non-finite loss or gradients, up to step {step} "
                f"(training.max_nonfinite_in_a_row={limit}); they were skipped")
    return ""
