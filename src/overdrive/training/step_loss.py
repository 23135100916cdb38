"""The loss of an optimizer step: the mean over every loss token of its global batch.

    loss(step) = sum of the per-token losses of every micro-batch on every data-parallel rank
                 / the loss tokens of the whole global batch

whatever the split (micro-batch x accumulation x data-parallel ranks). A mean of per-micro-batch
means would weigh a micro-batch with 3 loss tokens as much as one with 300 (chat data with
assistant-only loss, padding), and its gradient would not be the global batch's: the
accumulation fault Transformers fixed with `num_items_in_batch` and torchtitan avoids by
normalising by the global token count, as here.

The count is taken on the device before the step's first forward (its micro-batches are drawn
ahead) and summed over the ranks once per step. Each micro-batch's backward gets its summed loss
/ that count, scaled back by what the libraries divide by afterwards: Accelerate (or DeepSpeed's
engine, `scale_wrt_gas`) divides by the accumulation steps, and the gradient reduction (DDP,
FSDP, ZeRO) averages over the data-parallel ranks. So the gradient is the global batch's mean.

For sequence classification a row is the unit: the model's loss is its mean over the rows.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from overdrive.training import loss_kernels

IGNORE = -100


def loss_token_count(batch: Any) -> torch.Tensor:
    """Tokens (rows, for a label per row) this micro-batch puts in the loss, on the device.
    The model shifts: the first position of a row predicts nothing."""
    labels = batch["labels"]
    if labels.dim() < 2:
        return torch.full((), labels.numel(), dtype=torch.long, device=labels.device)
    return (labels[..., 1:] != IGNORE).sum()


def summed_loss(model: Any, batch: Any, kernel: str = "full") -> torch.Tensor:
    """The sum (not the mean) of this micro-batch's per-token losses, so an empty micro-batch
    adds 0 and not 0/0. The model's own causal-LM loss (its shift, or context parallel's
    `shift_labels`), reduced by sum: Transformers' `num_items_in_batch` divides a summed cross
    entropy by the count it is given, here 1 (the global count divides in the loop). Taken this way
    rather than recomputed from the logits, whose own cross entropy measured 10% slower per step.
    `kernel` other than "full" (`training.loss_kernel`): the same sum without the logits (loss_kernels.py)."""
    labels = batch["labels"]
    if labels.dim() < 2:  # a label per row: the model's mean x the rows
        return model(**batch).loss * labels.shape[0]
    if kernel != "full":
        return loss_kernels.summed_token_loss(model, batch, kernel)
    return model(**batch, num_items_in_batch=1).loss


def global_count(accelerator: Any, micro_batches: list, model_parallel: int,
                 units: Callable[[Any], torch.Tensor] = loss_token_count) -> torch.Tensor:
    """Loss tokens (or what `units` counts: a preference run's pairs) in the whole global batch:
    this rank's micro-batches, summed over every rank (one all-reduce, no host sync). The ranks of
    a tensor/context-parallel group share their batch, so each sample is counted `model_parallel`
    times: divided out."""
    local = sum((units(b).to(accelerator.device) for b in micro_batches),
                torch.zeros((), dtype=torch.long, device=accelerator.device))
    total = accelerator.reduce(local.to(accelerator.device), "sum") if accelerator.num_processes > 1 else local
    return (total // model_parallel).clamp(min=1).float()  # a step with no loss token: loss 0, no 0/0


def backward_scale(accumulation: int, data_parallel: int) -> int:
    """What the libraries divide the gradient by after backward: the accumulation steps
    (Accelerate, or DeepSpeed's engine) and the data-parallel ranks (the averaging all-reduce)."""
    return accumulation * data_parallel
