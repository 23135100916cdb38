"""Preference samples over the token cache: pair i is conversations 2i (chosen) and 2i+1
(rejected) of the chat layout, and the collator that puts a batch's chosen sequences and
then its rejected ones into one padded batch, so both are scored by one forward (as TRL's
`concatenated_forward`): rows [0, n) are chosen, [n, 2n) rejected."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from overdrive.data.chat_samples import IGNORE, Conversations


class Pairs(torch.utils.data.Dataset):
    """Row i: the chosen and the rejected sequence of pair i, with labels -100 outside the answer."""

    def __init__(self, conversations: Conversations):
        self.conversations = conversations

    def __len__(self) -> int:
        return len(self.conversations) // 2

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"pair {i} of {len(self)}")
        chosen, rejected = self.conversations[2 * i], self.conversations[2 * i + 1]
        return {"chosen_ids": chosen["input_ids"], "chosen_labels": chosen["labels"],
                "rejected_ids": rejected["input_ids"], "rejected_labels": rejected["labels"],
                "pair_index": torch.tensor(i)}


class PairCollator:
    """Chosen then rejected, right-padded to the longest of the batch; `pair_index` says which
    pairs they are (the precomputed reference log-probs are looked up by it)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        sequences = [(r["chosen_ids"], r["chosen_labels"]) for r in rows]
        sequences += [(r["rejected_ids"], r["rejected_labels"]) for r in rows]
        longest = max(len(ids) for ids, _ in sequences)
        ids = torch.full((len(sequences), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(sequences), longest), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for i, (row_ids, row_labels) in enumerate(sequences):
            n = len(row_ids)
            ids[i, :n], labels[i, :n], mask[i, :n] = row_ids, row_labels, 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "pair_index": torch.stack([r["pair_index"] for r in rows])}


def open_pairs(ids: np.ndarray, ends: np.ndarray, mask: np.ndarray) -> Optional[Pairs]:
    if len(ends) < 2:
        return None
    return Pairs(Conversations(ids, ends, mask))
