"""Chat training samples over the token cache: one conversation per row, or several packed.

Labels are the ids where the loss mask is on and -100 elsewhere (the model shifts them).
Packed rows carry `position_ids` that restart at 0 for each conversation and no attention
mask: from that, Transformers builds a block-diagonal causal mask (masking_utils
`find_packed_sequence_indices`; the varlen kernel under flash-attention), so a conversation
attends only to itself. Models whose forward takes no `position_ids` cannot be told, and
the run says so (`packing_note`).
"""

from __future__ import annotations

import inspect
from typing import Optional

import numpy as np
import torch

from overdrive.data.samples import IGNORE, _portable, _restore, row_span


def _labels(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.where(mask.astype(bool), ids, IGNORE)


class Conversations(torch.utils.data.Dataset):
    """Row i is conversation i: ids[ends[i-1]:ends[i]] and its labels."""

    def __init__(self, ids: np.ndarray, ends: np.ndarray, mask: np.ndarray):
        self.ids, self.ends, self.mask = ids, ends, mask

    def __len__(self) -> int:
        return len(self.ends)

    def span(self, i: int) -> tuple[int, int]:
        return row_span(self.ends, i, "conversation")

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start, end = self.span(i)
        ids: np.ndarray = self.ids[start:end].astype(np.int64)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(_labels(ids, self.mask[start:end]))}

    def __getstate__(self):
        return {k: _portable(getattr(self, k)) for k in ("ids", "ends", "mask")}

    def __setstate__(self, state):
        self.ids, self.ends, self.mask = (_restore(state[k]) for k in ("ids", "ends", "mask"))


def pack(lengths: np.ndarray, block: int) -> np.ndarray:
    """First conversation of each packed row: conversations in order, a new row when the next
    one would not fit (every conversation is at most `block` tokens: truncated or dropped)."""
    starts, used = [0] if len(lengths) else [], 0
    for i, n in enumerate(lengths.tolist()):
        if used + n > block and used:
            starts.append(i)
            used = 0
        used += n
    return np.asarray(starts, dtype=np.int64)


class PackedConversations(torch.utils.data.Dataset):
    """Rows of `block` tokens holding whole conversations, position ids restarting per conversation."""

    def __init__(self, conversations: Conversations, block: int, pad_id: int = 0):
        self.conversations, self.block, self.pad_id = conversations, block, pad_id
        ends = np.asarray(conversations.ends, dtype=np.int64)
        self.starts = pack(np.diff(ends, prepend=0), block)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"packed row {i} of {len(self)}")
        last = int(self.starts[i + 1]) if i + 1 < len(self.starts) else len(self.conversations)
        ids = torch.full((self.block,), self.pad_id, dtype=torch.long)
        labels = torch.full((self.block,), IGNORE, dtype=torch.long)
        positions = torch.zeros(self.block, dtype=torch.long)
        at = 0
        for c in range(int(self.starts[i]), last):
            row = self.conversations[c]
            n = len(row["input_ids"])
            ids[at:at + n], labels[at:at + n] = row["input_ids"], row["labels"]
            positions[at:at + n] = torch.arange(n)
            at += n
        positions[at:] = torch.arange(self.block - at)  # the padding is a sequence of its own
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


class ChatCollator:
    """Right-pads conversations to the longest in the batch (labels -100 there); packed rows,
    all `block` long already, are stacked."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        if "position_ids" in rows[0]:
            return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), longest), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["labels"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def open_chat(ids: np.ndarray, ends: np.ndarray, mask: np.ndarray, block: int, packing: bool,
              pad_id: int = 0) -> Optional[torch.utils.data.Dataset]:
    if not len(ends):
        return None
    rows = Conversations(ids, ends, mask)
    return PackedConversations(rows, block, pad_id) if packing else rows


def packing_note(model) -> str:
    """Empty when packed conversations are kept apart by this model; else why they are not."""
    forward = getattr(model, "forward", None)
    try:
        takes_positions = "position_ids" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        takes_positions = False
    if takes_positions:
        return ""
    return (f"data.packing: {type(model).__name__} takes no position_ids, so packed conversations attend to the "
            "ones before them in a row (set data.packing=false to keep them apart)")
