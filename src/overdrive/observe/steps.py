"""Always-on step timers: where each optimizer step's time goes on this rank.

The loop names the phase it enters (`recorder.enter("forward")`); the time since the last
call is added to the phase it leaves. That is one clock read and a few attribute stores per
call, cheap enough for every step of every run (bench/bench_observe.py measures it).

Phases: `data` (waiting for the next batch), `forward`, `backward`, `optimizer` (clipping,
step, zero_grad), `sync` (the loop's own small collectives: the stop agreement, the logged
loss), `checkpoint`, `eval`. Compute is forward + backward + optimizer; waiting is data and
sync, plus the part of backward spent after this rank's last gradient was ready (the
gradient reduction waiting for the other ranks: DDP's all-reduce, ZeRO's reduce, told apart
by a hook on each parameter's gradient accumulation), plus the wrapper's synchronisation
before the model's own forward begins (told apart by a forward pre-hook on the inner model).

Host clocks: on a GPU they measure when work was queued, not when it ran, so a run on CUDA
times its phases with CUDA events instead (device_steps.py); the profiler (`overdrive profile`)
measures the kernels themselves.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

PHASES = ("data", "forward", "backward", "optimizer", "sync", "checkpoint", "eval")
COMPUTE = ("forward", "backward", "optimizer")
# Phases in which a rank waits for the others (a hang shows the waiting ranks here).
WAITING = ("sync",)
STATES = ("setup", *PHASES, "finished")

# The live record another process on this machine reads (heartbeat.py maps it to a file):
# progress, step, phase index, phase start (wall clock), progress again. A reader that sees
# the two progress fields differ caught a write half done, and reads again.
LIVE = struct.Struct("<qqqdq")


@dataclass
class StepTimes:
    """Seconds per phase, summed over the optimizer steps of one window."""

    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    grad_wait: float = 0.0  # the part of `backward` after the last local gradient was ready

    def per_step(self) -> dict[str, float]:
        n = max(self.steps, 1)
        out = {f"{phase}_s": value / n for phase, value in self.seconds.items()}
        compute = sum(self.seconds[p] for p in COMPUTE) - self.grad_wait
        waiting = self.seconds["data"] + self.seconds["sync"] + self.grad_wait
        out.update(compute_s=compute / n, wait_s=waiting / n, grad_wait_s=self.grad_wait / n)
        return out


class StepRecorder:
    """The phase clock of one rank, and the state its heartbeat reports."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.step = 0  # optimizer steps done
        self.phase = "setup"
        self.since = clock()
        self.wall_since = time.time()  # when the current phase began, for other processes to read
        self.progress = 0  # changes whenever the phase changes: what the watchdog calls progress
        self.window = StepTimes()
        self.last_grad: Optional[float] = None
        self._backward_start: Optional[float] = None
        self._hooks: list[Any] = []
        self.live: Optional[Any] = None  # a shared memory map (heartbeat.py), or None

    def _publish(self) -> None:
        if self.live is not None:
            LIVE.pack_into(self.live, 0, self.progress, self.step, STATES.index(self.phase), self.wall_since,
                           self.progress)

    # ------------------------------------------------------------------ the loop's calls
    def enter(self, phase: str) -> None:
        now = self.clock()
        if self.phase in self.window.seconds:
            self.window.seconds[self.phase] += now - self.since
            if self.phase == "backward" and self.last_grad is not None and self.last_grad > self.since:
                self.window.grad_wait += now - self.last_grad
        if phase == "backward":
            self.last_grad = None
        self.phase, self.since, self.wall_since = phase, now, time.time()
        self.progress += 1
        self._publish()

    def wrapped_forward_started(self) -> None:
        """The wrapped model's own forward begins: the time since the loop entered `forward`
        was the wrapper's pre-forward synchronisation (DDP broadcasting buffers waits for
        every rank), which is waiting, not compute."""
        if self.phase == "forward":
            now = self.clock()
            self.window.seconds["sync"] += now - self.since
            self.since = now

    def step_done(self, step: int) -> None:
        """The end of optimizer step `step` (the loop's own count, so a resumed run is right)."""
        self.step = step
        self.window.steps += 1
        self.progress += 1
        self._publish()

    def read(self) -> StepTimes:
        """The window since the last read (per-step figures: `.per_step()`). The phase under
        way is cut at this moment, so consecutive windows add up to the time between reads."""
        now = self.clock()
        if self.phase in self.window.seconds:
            self.window.seconds[self.phase] += now - self.since
        self.since = now
        window, self.window = self.window, StepTimes()
        return window

    # ------------------------------------------------------------------ gradients
    def watch_gradients(self, parameters: Iterable[Any]) -> None:
        """Note when this rank's backward has produced its last gradient: after that moment,
        backward is only waiting for the gradient reduction across ranks."""
        for p in parameters:
            if getattr(p, "requires_grad", False) and hasattr(p, "register_post_accumulate_grad_hook"):
                try:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
                except RuntimeError:  # not a leaf (some wrappers): that parameter is not watched
                    continue

    def _grad_ready(self, _param: Any) -> None:
        self.last_grad = self.clock()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def state(self) -> dict[str, Any]:
        """What the heartbeat writes: read by another thread, so plain values only."""
        grad_ready_ago = None
        if self.phase == "backward" and self.last_grad is not None:
            grad_ready_ago = self.clock() - self.last_grad
        return {"step": self.step, "phase": self.phase, "phase_since": self.wall_since,
                "progress": self.progress, "grads_ready_s_ago": grad_ready_ago}


class NullRecorder(StepRecorder):
    """Timers off (the bench's baseline): every call does nothing."""

    def wrapped_forward_started(self) -> None:
        pass

    def enter(self, phase: str) -> None:  # noqa: D401 - intentionally empty
        pass

    def step_done(self, step: int) -> None:
        self.step = step

    def watch_gradients(self, parameters: Iterable[Any]) -> None:
        pass
