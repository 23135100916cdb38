"""What a long run does about its own accidents: an out-of-memory step retried at a smaller
micro-batch (`training.oom_retry`), a loss spike kept out of the weights
(`training.loss_spike`), checkpoints written in the background (`checkpoint.async`, on the
checkpoint section itself)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from overdrive.config.sections import Section


class LossSpikeConfig(Section):
    """A step far above its recent average (its loss, or its gradient norm where the objective's loss
    is no positive scale: training/guards/loss_spikes.py): skipped, not trained on.

    Off by default: judging a step needs its measure on the host before the optimizer steps, one
    host-device sync per step that an unwatched run does not pay."""

    factor: Optional[float] = Field(
        None, gt=1.0, description="Skip a step whose measure exceeds this factor x the moving average of the last "
        "`window` trained steps (every rank alike: no update, the data position advanced). The measure is the "
        "objective's: the loss per token (per row for classification) for causal LM and chat, the gradient norm "
        "for GRPO, the preference methods and the reward model, whose losses sit near or below zero. Empty: off.")
    window: int = Field(20, ge=1, description="Trained steps in the moving average; no step is judged before the "
                        "window is full.")
    max_in_a_row: int = Field(5, ge=1, description="Stop the run (with a checkpoint whose weights no spike touched) "
                              "after this many skipped spikes in a row.")
