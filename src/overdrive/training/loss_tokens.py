"""How many tokens the loss was taken over: metrics.jsonl's `loss_tokens`.

Packed text puts every token but each row's first into the loss; chat data only the
assistant's tokens (or, with data.train_on_prompt, all of a conversation's); padding never.
Counted on the device beside the summed loss, and read (a sync) only when the loss is.
"""

from __future__ import annotations

import torch

IGNORE = -100


class LossTokens:
    """Tokens in the loss since the last read, on this rank; `read` sums over the ranks."""

    def __init__(self, device, pending: int = 0):
        self.count = torch.full((), int(pending), dtype=torch.long, device=device)

    def add(self, batch) -> None:
        labels = batch.get("labels") if hasattr(batch, "get") else None
        if labels is None:
            return
        if labels.dim() < 2:  # a class label per row
            self.count += labels.numel()
        else:  # the model shifts: the first position of a row predicts nothing
            self.count += (labels[..., 1:] != IGNORE).sum()

    def total(self, accelerator) -> int:
        """Over every rank, without resetting (what a checkpoint records)."""
        return int(accelerator.reduce(self.count.clone(), "sum").item())

    def read(self, accelerator) -> int:
        value = self.total(accelerator)
        self.count.zero_()
        return value
