"""KTO's unpaired rows (`preference.method: kto`): rendered, stored and batched as TRL's KTOTrainer does.

A row (a prompt, a completion, desirable or not: preference_layouts.py) is rendered as TRL's
`_prepare_dataset` renders it: conversational rows through the chat template (the prompt with
the generation prompt, prompt + completion without), text rows by the tokenizer with EOS added
to the completion; the completion starts where the two first differ. A row whose prompt alone
fills `data.max_length` is dropped (TRL's filter), as is one whose completion renders to no token;
the counts are reported.

In the token cache a row is one sequence, prompt then completion, with the mask over the
completion's tokens holding 1 (desirable) or 2 (undesirable): the label travels with the
tokens, no file of its own. The completion is kept whole; the collator cuts each sequence at
`data.max_length` as TRL's DataCollatorForUnpairedPreference does, after the KL sequences are
made: row i's prompt with row i-1's completion, inside the micro-batch (TRL's rotation by one).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from overdrive.data.chat import KINDS
from overdrive.data.samples import IGNORE, row_span

DESIRABLE, UNDESIRABLE = 1, 2
Encoded = tuple[list[int], list[int]]  # (ids, mask)


class UnpairedEncoder:
    """Lists of rows -> lists of (ids, mask), None for a row dropped."""

    task = "preference"
    kinds = KINDS

    def __init__(self, tokenizer, max_length: int):
        from overdrive.data.preference import PreferenceEncoder

        self.pairs = PreferenceEncoder(tokenizer, max_length)  # its rendering of text and turns
        self.tokenizer, self.max_length = tokenizer, max_length
        self.counts = {"rows": 0, "desirable": 0, "truncated": 0, "dropped": 0, "loss_tokens": 0}

    def __call__(self, records: list[list[dict]]) -> list[list[Optional[Encoded]]]:
        return [[self.encode(row) for row in record] for record in records]

    def render(self, row: dict) -> tuple[list[int], list[int]]:
        """(prompt ids, completion ids) as TRL's KTOTrainer tokenizes them."""
        from overdrive.data.preference import common_prefix_length

        prompt, completion = row["prompt"], row["completion"]
        if isinstance(completion, list):
            prompt_ids = self.pairs._ids(prompt, add_generation_prompt=True)
            full = self.pairs._ids(prompt + completion)
        else:
            eos = self.tokenizer.eos_token or ""
            completion = completion if completion.endswith(eos) else completion + eos
            prompt_ids, full = self.pairs._ids(prompt), self.pairs._ids(prompt + completion)
        n = common_prefix_length(prompt_ids, full)
        return prompt_ids[:n], full[n:]

    def encode(self, row: dict) -> Optional[Encoded]:
        prompt, completion = self.render(row)
        self.counts["rows"] += 1
        if len(prompt) >= self.max_length or not completion:  # nothing of the completion to score
            self.counts["dropped"] += 1
            return None
        label = DESIRABLE if row["desirable"] else UNDESIRABLE
        self.counts["desirable"] += int(row["desirable"])
        self.counts["truncated"] += int(len(prompt) + len(completion) > self.max_length)
        self.counts["loss_tokens"] += min(len(completion), self.max_length - len(prompt))
        return prompt + completion, [0] * len(prompt) + [label] * len(completion)

    def append(self, writer, part: str, rows: list[int], encoded: list) -> None:
        kept = [one for i in rows for one in encoded[i] if one is not None]
        if not kept:
            return
        ends = np.cumsum([len(ids) for ids, _ in kept]) + writer.count(part)
        writer.append(part, np.concatenate([np.asarray(ids) for ids, _ in kept]), ends=ends.astype(np.int64),
                      mask=np.concatenate([np.asarray(m, dtype=np.uint8) for _, m in kept]))

    def summary(self) -> dict:
        return {"unpaired": {**self.counts, "max_length": self.max_length}}


def describe_counts(counts: dict) -> str:
    text = (f"{counts['rows']:,} rows ({counts['desirable']:,} desirable), "
            f"{counts['loss_tokens']:,} completion tokens")
    if counts["truncated"]:
        text += f"; {counts['truncated']:,} longer than {counts['max_length']} tokens truncated (data.max_length)"
    if counts["dropped"]:
        text += (f"; {counts['dropped']:,} dropped: the prompt alone fills {counts['max_length']} tokens "
                 "(data.max_length)")
    return text


class UnpairedRows(torch.utils.data.Dataset):
    """Row i: its prompt ids, completion ids and whether the completion is desirable."""

    def __init__(self, ids: np.ndarray, ends: np.ndarray, mask: np.ndarray):
        self.ids, self.ends, self.mask = ids, ends, mask

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start, end = row_span(self.ends, i)
        ids: np.ndarray = self.ids[start:end].astype(np.int64)
        mask = self.mask[start:end]
        prompt = int(np.argmax(mask != 0)) if mask.any() else len(mask)
        return {"prompt_ids": torch.from_numpy(ids[:prompt]), "completion_ids": torch.from_numpy(ids[prompt:]),
                "desirable": torch.tensor(bool(mask[-1] == DESIRABLE))}


def open_unpaired(ids: np.ndarray, ends: np.ndarray, mask: np.ndarray) -> Optional[UnpairedRows]:
    return UnpairedRows(ids, ends, mask) if len(ends) else None


class UnpairedCollator:
    """Each row's prompt + completion, and the KL sequences (row i's prompt + row i-1's
    completion), each cut at `max_length` and right-padded; labels -100 outside the completion."""

    def __init__(self, pad_id: int, max_length: int):
        self.pad_id, self.max_length = pad_id, max_length

    def _padded(self, prompts: list, completions: list, prefix: str) -> dict[str, torch.Tensor]:
        sequences = [(torch.cat([p, c])[:self.max_length], len(p)) for p, c in zip(prompts, completions)]
        longest = max(len(ids) for ids, _ in sequences)
        ids = torch.full((len(sequences), longest), self.pad_id, dtype=torch.long)
        labels = torch.full((len(sequences), longest), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(sequences), longest), dtype=torch.long)
        for i, (row, prompt) in enumerate(sequences):
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
            labels[i, prompt:len(row)] = row[prompt:]
        return {f"{prefix}input_ids": ids, f"{prefix}attention_mask": mask, f"{prefix}labels": labels}

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        prompts, completions = [r["prompt_ids"] for r in rows], [r["completion_ids"] for r in rows]
        rotated = completions[-1:] + completions[:-1]
        return {**self._padded(prompts, completions, ""), **self._padded(prompts, rotated, "kl_"),
                "desirable": torch.stack([r["desirable"] for r in rows])}
