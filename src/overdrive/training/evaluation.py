"""The validation pass: mean loss (and accuracy for classification) over a fixed subset; the
loss is the mean over every loss token of the subset, as a training step's is (step_loss.py)."""

from __future__ import annotations

import math
from typing import Any

import torch

from overdrive.training import step_loss


def evaluate(parts: Any, task: str, loss_kernel: str = "full") -> dict[str, float]:
    """Mean loss (and accuracy for classification) over the validation subset; a token loss by
    `loss_kernel` (the run's, settled: loss_kernels.for_run)."""
    acc, model = parts.accelerator, parts.model
    if getattr(parts, "objective", None) is not None:  # preference pairs: the method's loss and TRL's metrics
        return parts.objective.evaluate(model, parts.eval_loader)
    loss_sum, tokens = torch.zeros((), device=acc.device), torch.zeros((), device=acc.device)
    correct, seen = torch.zeros((), device=acc.device), 0
    # No gradients here: the chunked loop is the kernel that keeps no logits without them.
    kernel = "full" if loss_kernel == "full" else "chunked"
    model.eval()
    with torch.no_grad():
        for batch in parts.eval_loader:
            tokens += step_loss.loss_token_count(batch)
            if task != "sequence-classification":
                loss_sum += step_loss.summed_loss(model, batch, kernel).detach().float()
            else:
                out = model(**batch)
                loss_sum += out.loss.detach().float() * batch["labels"].shape[0]
                preds, labels = acc.gather_for_metrics((out.logits.argmax(dim=-1), batch["labels"]))
                correct += (preds == labels).sum()
                seen += labels.numel()
    model.train()
    # sync point: every rank's sums (a tensor-parallel group's ranks alike, so the ratio holds)
    mean_loss = (acc.reduce(loss_sum, "sum") / acc.reduce(tokens, "sum").clamp(min=1)).item()
    result = {"eval_loss": mean_loss}
    if task == "causal-lm":
        result["eval_perplexity"] = math.exp(min(mean_loss, 50.0))
    else:
        result["eval_accuracy"] = correct.item() / max(seen, 1)
    return result
