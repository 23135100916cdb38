"""How many tokens the loss was taken over: metrics.jsonl's `loss_tokens`.

Packed text puts every token but each row's first into the loss; chat data only the
assistant's tokens (or, with data.train_on_prompt, all of a conversation's); padding never.
Counted by step_loss.py's rule on the device beside the summed loss, and read (a sync) only
when the loss is.
"""

from __future__ import annotations

import torch

from overdrive.training.step.step_loss import loss_token_count


class LossTokens:
    """Tokens in the loss since the last read, on this rank; `read` sums over the ranks."""

    def __init__(self, device, pending: int = 0):
        self.count = torch.full((), int(pending), dtype=torch.long, device=device)

    def add(self, batch) -> None:
        if batch.get("labels") is not None:
            self.count += loss_token_count(batch).to(self.count.device)

    def total(self, accelerator) -> int:
        """Over every rank, without resetting (what a checkpoint records)."""
        return int(accelerator.reduce(self.count.clone(), "sum").item())

    def read(self, accelerator) -> int:
        value = self.total(accelerator)
        self.count.zero_()
        return value
