"""The loss of an optimizer step: the mean over every unit of its global batch. The one place
the loss is normalised: the unit rule, the ignore index, the backward scale, the logged divisor.

    loss(step) = sum over the loss's terms of
                   (the term summed over every micro-batch on every data-parallel rank
                    / that term's units in the whole global batch)

whatever the split (micro-batch x accumulation x data-parallel ranks). For causal LM and chat
the one term is the token cross entropy and its unit a loss token; preference methods count
pairs (ORPO adds a second term, the chosen answers' NLL over their tokens, as TRL's mean is);
classification counts rows. A mean of per-micro-batch means would weigh a micro-batch with 3
loss tokens as much as one with 300 (chat data with assistant-only loss, padding), and its
gradient would not be the global batch's: the accumulation fault Transformers fixed with
`num_items_in_batch` and torchtitan avoids by normalising by the global token count, as here.

The objective (training/objectives/objective.py) says, per micro-batch, its units (`counts`) and its
summed losses (`sums`), one entry per term. The counts are taken on the device before the
step's first forward (its micro-batches are drawn ahead) and summed over the ranks once per
step (`global_counts`). Each micro-batch's backward gets `share(sums, totals)`, scaled back by
what the libraries divide by afterwards (`backward_scale`): Accelerate (or DeepSpeed's engine,
`scale_wrt_gas`) divides by the accumulation steps, and the gradient reduction (DDP, FSDP,
ZeRO) averages over the data-parallel ranks. So the gradient is the global batch's mean, and
the shares of a step's micro-batches add up to its logged loss.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from overdrive.data.samples import IGNORE
from overdrive.training.step import loss_kernels

__all__ = ["IGNORE", "backward_scale", "global_counts", "loss_token_count", "share", "shifted_labels",
           "summed_loss"]


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts, as Transformers shifts: the next one (IGNORE at the end)."""
    return torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE)


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


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`summed_loss` from logits a caller already has (a pipeline's last stage): the same shift,
    the same ignore index, reduced by sum in fp32."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             shifted_labels(labels).reshape(-1), ignore_index=IGNORE,
                                             reduction="sum")


def global_counts(accelerator: Any, micro_batches: list, model_parallel: int,
                  counts: Callable[[Any], torch.Tensor] = loss_token_count) -> torch.Tensor:
    """The units of each loss term in the whole global batch: this rank's micro-batches, summed
    over every rank (one all-reduce, no host sync). The ranks of a tensor/context-parallel group
    share their batch, so each sample is counted `model_parallel` times: divided out."""
    local = sum((counts(b).to(accelerator.device).reshape(-1) for b in micro_batches))
    total = accelerator.reduce(local, "sum") if accelerator.num_processes > 1 else local
    return (total // model_parallel).clamp(min=1).float()  # a term with no unit: loss 0, no 0/0


def share(sums: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of the step's loss: each term's sum over its global units."""
    return (sums.reshape(-1) / totals).sum()


def backward_scale(accumulation: int, data_parallel: int) -> int:
    """What the libraries divide the gradient by after backward: the accumulation steps
    (Accelerate, or DeepSpeed's engine) and the data-parallel ranks (the averaging all-reduce)."""
    return accumulation * data_parallel
