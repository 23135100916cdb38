"""Step timers on the GPU's own clock.

On CUDA the host returns from `forward` once the kernels are queued: host clocks time the
queueing, and whatever waits for the device next (the optimizer step, the logged loss) absorbs
the rest. Here each phase change also records a CUDA event on the current stream, so a phase
lasts from the moment the device reached its start to the moment it reached the next one; the
events are resolved at the logging step, which synchronises already (no sync per step).

The host side (heartbeat, the watchdog's progress, the gradient-ready hooks) is the host
recorder's (steps.py); only the seconds per phase are replaced by the device's.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from overdrive.observe.steps import PHASES, StepRecorder, StepTimes


def cuda_event() -> Any:
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class DeviceStepRecorder(StepRecorder):
    def __init__(self, clock=time.perf_counter, event: Callable[[], Any] = cuda_event):
        super().__init__(clock)
        self._event = event
        self._spans: list[tuple[str, Any, Any]] = []  # (phase, the event at its start, at its end)
        self._mark: Optional[Any] = None

    def _cut(self, phase: str) -> None:
        """End the device span of `phase` here and start the next one."""
        mark = self._event()
        if phase in PHASES and self._mark is not None:
            self._spans.append((phase, self._mark, mark))
        self._mark = mark

    def enter(self, phase: str) -> None:
        self._cut(self.phase)
        super().enter(phase)

    def wrapped_forward_started(self) -> None:
        if self.phase == "forward":
            self._cut("sync")  # the wrapper's pre-forward synchronisation, as on the host
        super().wrapped_forward_started()

    def read(self) -> StepTimes:
        self._cut(self.phase)
        window = super().read()
        self._mark.synchronize()  # the logging step has synchronised: this returns at once
        seconds = dict.fromkeys(PHASES, 0.0)
        for phase, start, end in self._spans:
            seconds[phase] += start.elapsed_time(end) / 1000.0  # milliseconds
        self._spans = []
        window.seconds = seconds
        window.grad_wait = min(window.grad_wait, seconds["backward"])  # host-side hook, bounded by the device's
        return window


def recorder_for(device: Any) -> StepRecorder:
    """The step timers of a run on `device`: the GPU's clock on CUDA, the host's elsewhere."""
    return DeviceStepRecorder() if getattr(device, "type", None) == "cuda" else StepRecorder()
