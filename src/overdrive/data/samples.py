"""Training samples over the memory-mapped token cache: packed blocks, labelled rows, padding.

Both are map-style datasets (`__len__`, `__getitem__` by sample index) over arrays that may
be `numpy.memmap`s: a sample is read from the shared page cache when it is asked for. When a
DataLoader worker is started by pickling, a memmap travels as its file name and is mapped
again on the other side, instead of being copied whole.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

# The label that puts a position out of the loss: Transformers' and torch's ignore_index. Every
# module that writes or reads labels takes it from here.
IGNORE = -100


def _portable(array: np.ndarray):
    if isinstance(array, np.memmap) and array.filename:
        return ("memmap", array.filename, array.dtype.str, array.shape, array.offset)
    return array


def _restore(value) -> np.ndarray:
    if isinstance(value, tuple) and value and value[0] == "memmap":
        _, filename, dtype, shape, offset = value
        return np.memmap(filename, dtype=np.dtype(dtype), mode="r", shape=shape, offset=offset)
    return value


class PackedBlocks(torch.utils.data.Dataset):
    """Non-overlapping blocks of `block` tokens; labels are the inputs (the model shifts).

    With `document_end` (`data.document_mask`: the id the documents were joined with), each block
    also carries `position_ids` restarting at 0 after every such id, from which Transformers builds
    a block-diagonal causal mask (as for packed chat rows), and the first token of each document
    after the first is not predicted from the one before it (label -100): every token's loss is
    the one it has when its document is alone."""

    def __init__(self, tokens: np.ndarray, block: int, document_end: Optional[int] = None):
        self.tokens, self.block, self.document_end = tokens, block, document_end

    def __len__(self) -> int:
        return len(self.tokens) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} of {len(self)}")
        ids = torch.from_numpy(self.tokens[i * self.block:(i + 1) * self.block].astype(np.int64))
        if self.document_end is None:
            return {"input_ids": ids, "labels": ids}
        return {"input_ids": ids, **document_positions(ids, self.document_end)}

    def __getstate__(self):
        return {"tokens": _portable(self.tokens), "block": self.block, "document_end": self.document_end}

    def __setstate__(self, state):
        self.tokens, self.block = _restore(state["tokens"]), state["block"]
        self.document_end = state.get("document_end")


def document_positions(ids: torch.Tensor, document_end: int) -> dict[str, torch.Tensor]:
    """Position ids restarting after each `document_end` in `ids`, and labels with -100 at each
    document's first token after the first (its predecessor ends another document)."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[1:] = ids[:-1] == document_end
    index = torch.arange(len(ids))
    # Each position minus the index of the latest document start at or before it.
    latest = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=0).values
    labels = ids.masked_fill(starts, IGNORE)
    return {"labels": labels, "position_ids": index - latest}


def row_span(ends: np.ndarray, i: int, what: str = "row") -> tuple[int, int]:
    """Where row i of variable-length rows stored end to end lies: ids[start:end], `ends` each
    row's end; an index outside them is an IndexError naming `what`."""
    if not 0 <= i < len(ends):
        raise IndexError(f"{what} {i} of {len(ends)}")
    return (int(ends[i - 1]) if i else 0), int(ends[i])


class LabeledTexts(torch.utils.data.Dataset):
    """Variable-length token ids with one class label each: row i is ids[ends[i-1]:ends[i]]."""

    def __init__(self, ids: np.ndarray, ends: np.ndarray, labels: np.ndarray):
        self.ids, self.ends, self.labels = ids, ends, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start, end = row_span(self.ends, i)
        ids: np.ndarray = self.ids[start:end].astype(np.int64)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.tensor(int(self.labels[i]))}

    def __getstate__(self):
        return {k: _portable(v) for k, v in (("ids", self.ids), ("ends", self.ends), ("labels", self.labels))}

    def __setstate__(self, state):
        self.ids, self.ends, self.labels = (_restore(state[k]) for k in ("ids", "ends", "labels"))


class PadCollator:
    """Right-pads a classification batch to its longest row (a class, so workers can pickle it)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r["input_ids"])] = r["input_ids"]
            mask[i, :len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([r["labels"] for r in rows])}
