"""Did the fp16 loss scaler skip this optimizer step?

Accelerate reports a skip when its patched `optimizer.step` was not called by the GradScaler. A
fused (or capturable) optimizer is always called: the scaler hands it `found_inf` and the kernel
skips the update inside, so Accelerate says "not skipped" while nothing was applied. The scaler
lowering its scale at `update()` says it for every optimizer (Transformers' Trainer reads it the
same way): reading the scale costs a host-device sync, paid only by fp16 runs with a scaler.
"""

from __future__ import annotations

from typing import Any, Optional


class ScaleWatch:
    def __init__(self, scaler: Any):
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.scale: Optional[float] = None

    def before_step(self) -> None:
        """The scale the coming optimizer step starts from (it changes only at the step)."""
        if self.scaler is not None:
            self.scale = self.scaler.get_scale()

    def skipped(self, accelerator: Any) -> bool:
        if accelerator.optimizer_step_was_skipped:
            return True
        return self.scale is not None and self.scaler.get_scale() < self.scale
