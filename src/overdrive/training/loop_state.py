"""What the loop carries between steps and hands back: where it is (`LoopState`, saved and
restored whole by the checkpoint), where it was when a step began (`StepMark`, for a redo), the
data position it keeps while drawing micro-batches, what it found out (`Outcome`) and the result
of a run (`TrainResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional


@dataclass
class LoopState:
    """Where the loop is: with model, optimizer, schedule and RNG states, a resumable point.
    The checkpoint saves it whole (`state_dict`) and restores it whole (`load_state_dict`)."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # passes over the training data started
    batch_in_epoch: int = 0  # micro-batches consumed in the current epoch (data position)
    tokens_seen: int = 0  # across all processes
    nonfinite_in_a_row: int = 0
    # This rank's share of each step's loss (its summed token losses / the global batch's loss
    # tokens, step_loss.py), summed on the device since the last log point (no sync per step),
    # and the micro-batches in that sum: a resume carries on the interval being summed.
    loss_sum: Any = 0.0
    micro_steps: int = 0
    loss_tokens: int = 0  # tokens in the loss since the last log point, all ranks (set when saved)
    first_loss: Optional[float] = None  # the first and latest logged losses
    final_loss: Optional[float] = None
    source_positions: Optional[dict] = None  # a data mixture: where each source is (data/mixing.py)
    preference_pending: Optional[list] = None  # preference metrics summed since the last log point, all ranks
    loss_window: Optional[list] = None  # training.loss_spike: the last trained steps' losses (loss_spikes.py)
    spikes_in_a_row: int = 0

    def state_dict(self) -> dict[str, Any]:
        """Every field but the loss sum, which lives on the device (the checkpoint gathers it)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "loss_sum"}

    def load_state_dict(self, values: dict[str, Any]) -> None:
        for f in fields(self):
            if f.name in values:
                setattr(self, f.name, values[f.name])


@dataclass
class StepMark:
    """Where the loop was when a step began: put back before the step is redone (training.oom_retry)."""

    epoch: int
    batch_in_epoch: int
    tokens_seen: int
    micro_steps: int
    loss_sum: Any  # tensors on the device
    loss_tokens: Any
    objective: Any  # the objective's metric sums (Objective.snapshot)

    @classmethod
    def of(cls, state: LoopState, loss_tokens: Any, objective: Any, needed: bool) -> "StepMark":
        """The mark of `state` (and of the tokens counted and the objective's sums beside it); when no
        step can be redone (`needed` false), an empty one: nothing is copied."""
        if not needed:
            return cls(0, 0, 0, 0, None, None, None)
        return cls(state.epoch, state.batch_in_epoch, state.tokens_seen, state.micro_steps, state.loss_sum.clone(),
                   loss_tokens.clone(), objective.snapshot())

    def put_back(self, state: LoopState, loss_tokens: Any, objective: Any) -> None:
        state.epoch, state.batch_in_epoch, state.tokens_seen, state.micro_steps = (
            self.epoch, self.batch_in_epoch, self.tokens_seen, self.micro_steps)
        state.loss_sum.copy_(self.loss_sum)
        loss_tokens.copy_(self.loss_tokens)
        objective.rewind(self.objective)


@dataclass
class Outcome:
    """What the loop found out beyond its state; train() turns both into the TrainResult."""

    eval: dict[str, float] = field(default_factory=dict)
    stopped_early: str = ""
    stopped_by: int = 0
    checkpoint: Optional[Path] = None
    tokens_per_s: float = 0.0
    elapsed_s: float = 0.0
    eval_failed: str = ""  # why the closing evaluation failed, after the model was saved


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    first_loss: Optional[float] = None
    final_loss: Optional[float] = None
    eval: dict[str, float] = field(default_factory=dict)
    tokens_per_s: float = 0.0  # mean after the first logged step (which includes warm-up)
    elapsed_s: float = 0.0
    is_main_process: bool = True
    stopped_early: str = ""
    stopped_by: int = 0  # the signal (SIGTERM, SIGINT) that stopped the run after a checkpoint
    checkpoint: Optional[Path] = None  # the last checkpoint written or resumed from
    eval_failed: str = ""  # the closing evaluation failed (said on exit, non-zero); the model was saved first


def batches(loader, state: LoopState, skip_first_batches=None):
    """Micro-batches forever, epoch after epoch; keeps the data position in `state`.

    A resumed run starts inside an epoch: that epoch's loader skips the batches already
    trained on by index (nothing is loaded), so the order is the uninterrupted run's.
    """
    while True:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(state.epoch)
        epoch = loader
        if state.batch_in_epoch and skip_first_batches is not None:
            epoch = skip_first_batches(loader, state.batch_in_epoch)
        for batch_ in epoch:
            state.batch_in_epoch += 1
            yield batch_
        state.epoch += 1
        state.batch_in_epoch = 0
