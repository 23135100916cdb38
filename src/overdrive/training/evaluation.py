"""The validation pass: mean loss (and accuracy for classification) over a fixed subset."""

from __future__ import annotations

import math
from typing import Any

import torch


def evaluate(parts: Any, task: str) -> dict[str, float]:
    """Mean loss (and accuracy for classification) over the validation subset."""
    acc, model = parts.accelerator, parts.model
    if getattr(parts, "objective", None) is not None:  # preference pairs: the method's loss and TRL's metrics
        return parts.objective.evaluate(model, parts.eval_loader)
    loss_sum = torch.zeros((), device=acc.device)
    n_batches, correct, seen = 0, torch.zeros((), device=acc.device), 0
    model.eval()
    with torch.no_grad():
        for batch in parts.eval_loader:
            out = model(**batch)
            loss_sum += out.loss.detach().float()
            n_batches += 1
            if task == "sequence-classification":
                preds, labels = acc.gather_for_metrics((out.logits.argmax(dim=-1), batch["labels"]))
                correct += (preds == labels).sum()
                seen += labels.numel()
    model.train()
    mean_loss = acc.reduce(loss_sum / max(n_batches, 1), "mean").item()  # sync point
    result = {"eval_loss": mean_loss}
    if task == "causal-lm":
        result["eval_perplexity"] = math.exp(min(mean_loss, 50.0))
    else:
        result["eval_accuracy"] = correct.item() / max(seen, 1)
    return result
