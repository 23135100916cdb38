"""How a step's micro-batches go through the model: one piece of the composed step.

    forward_backward(loop, micro_batches, totals) -> the step's loss (this rank's share, on the device)

Each runs the objective (training/objectives/objective.py) on the micro-batches it is given, backward
included, with the step's global unit counts `totals` (step_loss.py), and leaves the step's
gradients whole; it never steps the optimizer: the loop keeps the books (clipping, the guards,
the optimizer, the schedule) once, whichever ran.

- `plain`: each micro-batch forward and backward under `accelerator.accumulate`, its sequences
  first sharded over the context-parallel group where the layout has one (context_parallel.py);
- training/step/pipeline.py's `Pipeline.forward_backward`: the schedule over the stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from overdrive.config.batch import BatchSplit
from overdrive.config.schema import RunConfig
from overdrive.training.step import context_parallel, step_loss

if TYPE_CHECKING:
    from accelerate import Accelerator

    from overdrive.observe.run import RunObserver
    from overdrive.training.guards.loss_spikes import LossSpikes
    from overdrive.training.guards.oom_retry import OomRetry
    from overdrive.training.objectives.objective import Objective


class StepParts(Protocol):
    """What a forward-backward asks of the run's parts (training/build/parts.py's Parts)."""

    accelerator: "Accelerator"
    model: torch.nn.Module
    objective: "Objective"


class Books(Protocol):
    """What a forward-backward asks of the loop that keeps the books (training/loop.py's Loop)."""

    cfg: RunConfig
    parts: StepParts
    split: BatchSplit
    cp: int  # ranks that each take a slice of every sequence
    observe: "RunObserver"  # where the step's time goes
    spikes: "LossSpikes"  # the step's loss, judged before the optimizer steps
    oom: "OomRetry"  # backward, with an out-of-memory error agreed over the ranks


def plain(loop: Books, micro_batches: list, totals: torch.Tensor) -> torch.Tensor:
    """Forward and backward of each micro-batch under Accelerate's accumulation: the gradients
    are synchronised over the data-parallel ranks at the last one (and DeepSpeed's engine ends
    its accumulation there)."""
    acc, model, objective = loop.parts.accelerator, loop.parts.model, loop.parts.objective
    # Under context parallel each rank's slice adds its own tokens' losses, and the gradient
    # reduction averages over data-parallel x cp ranks: the slices' sum is scaled back too.
    scale = step_loss.backward_scale(loop.split.accumulation, loop.split.data_parallel * loop.cp)
    loss = torch.zeros((), device=acc.device)
    for micro_batch in micro_batches:
        with acc.accumulate(model):
            inputs, sequences = context_parallel.sharding(acc, loop.cfg, micro_batch)
            with sequences:  # cp_size > 1: this rank's slice of every sequence, forward and backward
                loop.observe.enter("forward")
                share = step_loss.share(objective.sums(model, inputs), totals)  # its share of the step's mean
                loop.spikes.add(share)  # judged before the optimizer steps (loss_spikes.py)
                loop.observe.enter("backward")
                # undone by the accumulation and data-parallel averaging; an out-of-memory error
                # agreed over the ranks (oom_retry.py)
                loop.oom.backward(acc, share * scale)
        loss += share.detach().float()
    if not acc.sync_gradients:  # Accelerate counts micro-batches: its count must end with the step's
        raise RuntimeError("accumulation out of step with the data: the gradients were not synchronised")
    return loss
