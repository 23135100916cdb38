"""The training loop's one handle on this package: `RunObserver`.

train() opens one for the run (`for_run`); the loop tells it which phase it enters and when
a step ends, and asks it at each logging step for the fields metrics.jsonl gains: this
rank's seconds per step in each phase, compute and waiting, every rank's compute, and the
straggler if there is one (a small gather at the logging step, which already syncs).
"""

from __future__ import annotations

import socket
from typing import Any, Callable, Optional

from overdrive.observe.heartbeat import Heartbeat
from overdrive.observe.steps import NullRecorder, StepRecorder
from overdrive.observe.stragglers import StragglerWatch


class RunObserver:
    def __init__(self, output_dir, accelerator, recorder: Optional[StepRecorder] = None, heartbeat: bool = True):
        self.acc = accelerator
        self.recorder = recorder or StepRecorder()
        self.heartbeat = Heartbeat(self.recorder, output_dir, accelerator.process_index,
                                   accelerator.local_process_index, accelerator.num_processes) if heartbeat else None
        self.hosts = [socket.gethostname()]
        self.stragglers = StragglerWatch(self.hosts)
        self.say: Callable[[str], None] = lambda text: None
        self._hooks: list[Any] = []

    def __enter__(self) -> "RunObserver":
        if self.acc.num_processes > 1:
            from accelerate.utils import gather_object

            self.hosts = list(gather_object([socket.gethostname()]))  # once: which machine each rank is on
            self.stragglers = StragglerWatch(self.hosts)
        if self.heartbeat is not None:
            self.heartbeat.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self.recorder.close()
        if self.heartbeat is not None:
            self.heartbeat.__exit__(*exc)

    # ------------------------------------------------------------------ the loop's calls
    def watch(self, model: Any) -> None:
        self.recorder.watch_gradients(model.parameters())
        inner = self.acc.unwrap_model(model, keep_torch_compile=False)
        if inner is not model and not isinstance(self.recorder, NullRecorder):
            self._hooks.append(inner.register_forward_pre_hook(lambda *_: self.recorder.wrapped_forward_started()))

    def enter(self, phase: str) -> None:
        self.recorder.enter(phase)

    def step_done(self, step: int) -> None:
        self.recorder.step_done(step)

    def fields(self) -> dict[str, Any]:
        """metrics.jsonl fields for the window since the last call (a logging step: every rank
        calls it at the same step, since it gathers)."""
        times = self.recorder.read()
        if isinstance(self.recorder, NullRecorder):
            return {}
        mine = times.per_step()
        out: dict[str, Any] = {k: round(v, 6) for k, v in mine.items()}
        if self.acc.num_processes > 1:
            import torch

            local = torch.tensor([mine["compute_s"], mine["wait_s"]], dtype=torch.float64, device=self.acc.device)
            every = self.acc.gather(local).view(-1, 2).tolist()
            compute = [row[0] for row in every]
            out.update(rank_compute_s=[round(v, 6) for v in compute], rank_wait_s=[round(r[1], 6) for r in every],
                       rank_host=self.hosts)
            fresh = self.stragglers.add(compute)
            if fresh is not None:
                self.say(fresh.sentence())
            current = self.stragglers.current()
            out.update(straggler=current.rank if current else None,
                       straggler_host=current.host if current else None)
        return out


def for_run(output_dir, accelerator, timers: bool = True) -> RunObserver:
    """The observer of a training run; `timers=False` turns the step timers and heartbeats off
    (the bench's baseline, measuring what they cost)."""
    if not timers:
        return RunObserver(output_dir, accelerator, NullRecorder(), heartbeat=False)
    from overdrive.observe.device_steps import recorder_for

    return RunObserver(output_dir, accelerator, recorder_for(accelerator.device))
