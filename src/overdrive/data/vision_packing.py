"""Conversations with images packed into rows of `data.max_length` tokens (`data.packing` on a vision-language
model): each row's images go with it, attention stays within each conversation, positions restart per
conversation, so every token's loss is the one it has unpacked (tests/test_vlm_packing.py, to 1e-5).

How the model is told where a conversation ends: no attention mask, and position ids restarting at 0 for each
conversation, from which Transformers builds a block-diagonal causal mask (masking_utils
`find_packed_sequence_indices`, as for packed text chat: data/chat_samples.py). Qwen2-VL's positions are 3-D
(temporal, height, width over image tokens): each conversation's are the model's own `get_rope_index` of that
conversation alone, concatenated, with the 1-D text positions (restarting likewise) on top, the [4, batch, seq]
form its forward reads as packed. The images are concatenated in the order their tokens come, as the model
scatters image features over image tokens in that order.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from overdrive.data.chat_samples import pack
from overdrive.data.vision_rows import IGNORE, SEQUENCE

PACKED = ("input_ids", "labels", "mm_token_type_ids", "token_type_ids")  # per token, concatenated and padded


class PackedVisionRows(torch.utils.data.Dataset):
    """Rows of `block` tokens holding whole conversations (and their images), in order."""

    def __init__(self, rows: list[dict], block: int, pad_id: int, rope: Optional[Callable]):
        self.rows, self.block, self.pad_id, self.rope = rows, block, pad_id, rope
        self.starts = pack(np.asarray([len(r["input_ids"]) for r in rows], dtype=np.int64), block)

    def __len__(self) -> int:
        return len(self.starts)

    def _positions(self, row: dict) -> torch.Tensor:
        n = len(row["input_ids"])
        text = torch.arange(n)
        if self.rope is None:
            return text
        if "image_grid_thw" not in row:  # a conversation without images: its 3-D positions are its text positions
            return text.expand(4, n)
        rope = self.rope(row["input_ids"][None], row["mm_token_type_ids"][None], row["image_grid_thw"])
        return torch.cat([text[None], rope.to(text.dtype)])

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(f"packed row {i} of {len(self)}")
        last = int(self.starts[i + 1]) if i + 1 < len(self.starts) else len(self.rows)
        rows = self.rows[int(self.starts[i]):last]
        used = sum(len(r["input_ids"]) for r in rows)
        pad = self.block - used
        fill = {"input_ids": self.pad_id, "labels": IGNORE}
        out = {key: torch.cat([r[key] for r in rows] + [torch.full((pad,), fill.get(key, 0), dtype=rows[0][key].dtype)])
               for key in PACKED if key in rows[0]}
        positions = torch.cat([self._positions(r) for r in rows], dim=-1)
        tail = torch.arange(pad)  # the padding is a sequence of its own
        out["position_ids"] = torch.cat([positions, tail.expand(*positions.shape[:-1], pad)], dim=-1)
        images = {key for r in rows for key in r if key not in SEQUENCE}
        for key in sorted(images):
            out[key] = torch.cat([r[key] for r in rows if key in r], dim=0)
        return out
