"""`training.loss_spike`: a step far above its recent average is not trained on.

A corrupt shard or a bad batch makes a finite loss spike; applying its gradient can throw a long
run off (llm-foundry's KillLossSpike, Megatron's SpikyLossDetector skip or stop on them). Here a
step whose measure exceeds `factor` x the mean of the last `window` trained steps' measures is
skipped on every rank alike: the optimizer does not step (weights and optimizer state stay as
they were), the schedule waits with them, the data position moves on past the batch, and the
skip is counted (metrics.jsonl `loss_spikes_skipped`) and said. After `max_in_a_row` spikes in a
row the run stops; the checkpoint it saves then holds the weights from before the spikes (none
of them touched the weights), with the data position past them.

The measure is the objective's to declare (`Objective.spike_measure`), since "F x the mean" only
means something for a value on a positive scale that sits well above zero while training goes well:

- `loss`: the step's loss per unit (per loss token for causal LM and chat, per row for
  classification), which a bad batch lifts and ordinary steps keep near their average;
- `grad_norm`: the step's gradient norm over every rank (before clipping), for objectives whose
  loss is not such a scale: GRPO's sits near zero and goes negative, and the preference methods'
  and the reward model's fall towards zero as the margins grow, so a ratio to their mean would
  call ordinary steps spikes. A bad batch (a broken reward, scrambled labels) pulls the weights
  hard, which is what the norm shows.

Judging needs the measure on the host before the optimizer steps: one host-device sync per step
(and, for the loss, one all-reduce), paid only when `factor` is set; the gradient norm is the one
clipping takes anyway. No step is judged before the window is full, nor against a mean that is
not above zero. The window and the run of spikes are part of the loop state, so a resumed run
judges the next step as the uninterrupted run would.

`OVERDRIVE_FAULT_INJECT=spike:step=K` (config/fault_injection.py) corrupts step K's micro-batches
on every rank, as the objective says a bad batch of its own looks (`Objective.corrupt`: random
token ids where there were labels; for GRPO, advantages of a broken reward).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from overdrive.config.fault_injection import Injection
from overdrive.config.schema import RunConfig

MEASURES = {"loss": "loss", "grad_norm": "gradient norm"}  # Objective.spike_measure -> what the note calls it


class LossSpikes:
    """Judges each step's loss before the optimizer steps; the loop asks `allows_step`."""

    def __init__(self, cfg: RunConfig, accelerator: Any, state: Any, injection: Injection, sharing: int,
                 measure: str = "loss"):
        spec = cfg.training.loss_spike
        self.factor, self.window, self.max_in_a_row = spec.factor, spec.window, spec.max_in_a_row
        self.enabled = self.factor is not None
        self.measure = measure  # the objective's (Objective.spike_measure): "loss" or "grad_norm"
        self.acc, self.state, self.sharing = accelerator, state, sharing
        self.scramble_at = injection.spike_step
        self.step_loss: Optional[torch.Tensor] = None  # this rank's share of the step's loss, on the device
        self.skipped = False  # the current step was a spike
        self.since_log = 0
        self.note = ""
        if state.loss_window is None:
            state.loss_window = []

    @property
    def needs_norm(self) -> bool:
        """The loop measures the gradient norm for this guard (clipping to infinity when not clipping)."""
        return self.enabled and self.measure == "grad_norm"

    def injected(self, objective: Any, micro_batches: list, step: int) -> list:
        """The step's micro-batches, corrupted as the objective says when the test hook asks for this step."""
        if self.scramble_at != step:
            return micro_batches
        generator = torch.Generator().manual_seed(step)
        return [objective.corrupt(batch, generator) for batch in micro_batches]

    def add(self, loss: torch.Tensor) -> None:
        """A micro-batch's share of the step's loss (no sync)."""
        if self.enabled and self.measure == "loss":
            value = loss.detach().float()
            self.step_loss = value if self.step_loss is None else self.step_loss + value

    def rewind(self) -> None:
        """A step begun again (training.oom_retry): its loss is summed afresh."""
        self.step_loss = None

    def allows_step(self, grad_norm: Optional[Any] = None) -> bool:
        """At the accumulation's last micro-batch: the step's measure over all ranks, judged (the sync)."""
        if not self.enabled or not self.acc.sync_gradients:
            return True
        if self.measure == "grad_norm":  # already over every rank (and stage): clipping reduced it
            norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            self.skipped = self._judge(float(norm))
            return not self.skipped
        local = self.step_loss if self.step_loss is not None else torch.zeros((), device=self.acc.device)
        self.step_loss = None
        total = self.acc.reduce(local.clone(), "sum") if self.acc.num_processes > 1 else local
        self.skipped = self._judge(float(total.item()) / self.sharing)
        return not self.skipped

    def _judge(self, value: float) -> bool:
        state, step = self.state, self.state.step + 1
        window = state.loss_window
        if not math.isfinite(value):  # the non-finite guard's to judge; not a level to average
            return False
        mean = sum(window) / len(window) if window else 0.0
        # A mean at or below zero is no scale to be a multiple of: judged once the window has one.
        if len(window) >= self.window and mean > 0 and value > self.factor * mean:
            state.spikes_in_a_row += 1
            self.since_log += 1
            what = MEASURES[self.measure]
            self.note = (f"step {step}: {what} {value:.4g} is {value / mean:.1f} x the mean of the last {len(window)} "
                         f"steps ({mean:.4g}): skipped, the weights untouched (training.loss_spike.factor="
                         f"{self.factor:g}; {state.spikes_in_a_row} in a row)")
            return True
        window.append(value)
        del window[:-self.window]
        state.spikes_in_a_row = 0
        return False

    def after_step(self, loop: Any) -> None:
        """Say a skip; stop the run after `max_in_a_row` of them (its checkpoint: weights from before them)."""
        if not self.skipped:
            return
        self.skipped = False
        loop.progress.print(self.note)
        if self.state.spikes_in_a_row >= self.max_in_a_row and not loop.outcome.stopped_early:
            loop.outcome.stopped_early = (
                f"{self.state.spikes_in_a_row} loss spikes in a row up to step {self.state.step} "
                f"(training.loss_spike.max_in_a_row={self.max_in_a_row}); none was trained on, so the checkpoint "
                "saved now holds the weights from before them")
            loop.progress.print(f"stopping: {loop.outcome.stopped_early}")

    def record(self) -> dict[str, int]:
        """metrics.jsonl's count of skipped spikes since the last log (only when the feature is on)."""
        if not self.enabled:
            return {}
        count, self.since_log = self.since_log, 0
        return {"loss_spikes_skipped": count}
