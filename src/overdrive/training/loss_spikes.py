"""`training.loss_spike`: a step whose loss is far above its recent average is not trained on.

A corrupt shard or a bad batch makes a finite loss spike; applying its gradient can throw a long
run off (llm-foundry's KillLossSpike, Megatron's SpikyLossDetector skip or stop on them). Here a
step whose loss exceeds `factor` x the mean of the last `window` trained steps' losses is
skipped on every rank alike: the optimizer does not step (weights and optimizer state stay as
they were), the schedule waits with them, the data position moves on past the batch, and the
skip is counted (metrics.jsonl `loss_spikes_skipped`) and said. After `max_in_a_row` spikes in a
row the run stops; the checkpoint it saves then holds the weights from before the spikes (none
of them touched the weights), with the data position past them.

Judging needs the step's loss on the host before the optimizer steps: the loss is summed on the
device, so this is one all-reduce and one host-device sync per step, paid only when `factor`
is set. No step is judged until the window is full. The window and the run of spikes are part
of the loop state, so a resumed run judges the next step as the uninterrupted run would.

`OVERDRIVE_FAULT_INJECT=spike:step=K` (config/fault_injection.py) scrambles step K's labels on
every rank (random token ids where there were labels): a batch the model cannot predict.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from overdrive.config.fault_injection import Injection
from overdrive.config.schema import RunConfig

from overdrive.training.step_loss import IGNORE


class LossSpikes:
    """Judges each step's loss before the optimizer steps; the loop asks `allows_step`."""

    def __init__(self, cfg: RunConfig, accelerator: Any, state: Any, injection: Injection, sharing: int):
        spec = cfg.training.loss_spike
        self.factor, self.window, self.max_in_a_row = spec.factor, spec.window, spec.max_in_a_row
        self.enabled = self.factor is not None
        self.acc, self.state, self.sharing = accelerator, state, sharing
        self.scramble_at = injection.spike_step
        self.step_loss: Optional[torch.Tensor] = None  # this rank's share of the step's loss, on the device
        self.skipped = False  # the current step was a spike
        self.since_log = 0
        self.note = ""
        if state.loss_window is None:
            state.loss_window = []

    def injected(self, micro_batches: list, step: int) -> list:
        """The step's micro-batches, their labels scrambled when the test hook asks for this step."""
        if self.scramble_at != step:
            return micro_batches
        generator = torch.Generator().manual_seed(step)
        scrambled = []
        for batch in micro_batches:
            labels = batch["labels"]
            high = int(batch["input_ids"].max()) + 1
            noise = torch.randint(0, high, labels.shape, generator=generator).to(labels.device, labels.dtype)
            scrambled.append({**batch, "labels": torch.where(labels == IGNORE, labels, noise)})
        return scrambled

    def add(self, loss: torch.Tensor) -> None:
        """A micro-batch's share of the step's loss (no sync)."""
        if self.enabled:
            value = loss.detach().float()
            self.step_loss = value if self.step_loss is None else self.step_loss + value

    def allows_step(self) -> bool:
        """At the accumulation's last micro-batch: the step's loss over all ranks, judged (the sync)."""
        if not self.enabled or not self.acc.sync_gradients:
            return True
        local = self.step_loss if self.step_loss is not None else torch.zeros((), device=self.acc.device)
        self.step_loss = None
        total = self.acc.reduce(local.clone(), "sum") if self.acc.num_processes > 1 else local
        self.skipped = self._judge(float(total.item()) / self.sharing)
        return not self.skipped

    def _judge(self, loss: float) -> bool:
        state, step = self.state, self.state.step + 1
        window = state.loss_window
        if not math.isfinite(loss):  # the non-finite guard's to judge; not a level to average
            return False
        if len(window) >= self.window:
            mean = sum(window) / len(window)
            if loss > self.factor * mean:
                state.spikes_in_a_row += 1
                self.since_log += 1
                self.note = (f"step {step}: loss {loss:.4g} is {loss / mean:.1f} x the mean of the last {len(window)} "
                             f"steps ({mean:.4g}): skipped, the weights untouched (training.loss_spike.factor="
                             f"{self.factor:g}; {state.spikes_in_a_row} in a row)")
                return True
        window.append(loss)
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
