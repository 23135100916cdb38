"""Token ids: text through the tokenizer, cached as numpy arrays keyed by content and tokenizer.

`tokenize_splits(...)` stores the ids under `<cache_dir>/tokens/`, keyed by a hash of the
text and of the tokenizer, so a second run skips tokenizing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from overdrive.data.sources import TextSplits, content_hash, iter_column
from overdrive.errors import Problem, UserError

_TOKENS_RECIPE = "tokens-v1"  # bump when tokenization changes, to invalidate the cache


@dataclass
class TokenizedSplits:
    train: torch.utils.data.Dataset
    validation: Optional[torch.utils.data.Dataset]
    seq_len: int
    label_names: list[str] = field(default_factory=list)


def tokenizer_hash(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def token_stream(texts: Iterable[str], tokenizer, batch_size: int = 512) -> np.ndarray:
    """All documents' ids concatenated, each followed by the end-of-document id."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max else np.int32
    chunks, batch = [], []

    def flush():
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            chunks.append(np.asarray(ids + ([eos] if eos is not None else []), dtype=dtype))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)


class PackedBlocks(torch.utils.data.Dataset):
    """Non-overlapping blocks of `block` tokens; labels are the inputs (the model shifts)."""

    def __init__(self, tokens: np.ndarray, block: int):
        self.tokens, self.block = tokens, block

    def __len__(self) -> int:
        return len(self.tokens) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.tokens[i * self.block:(i + 1) * self.block].astype(np.int64))
        return {"input_ids": ids, "labels": ids}


class LabeledTexts(torch.utils.data.Dataset):
    """Variable-length token ids with one class label each (stored flat with offsets)."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray, labels: np.ndarray):
        self.ids, self.offsets, self.labels = ids, offsets, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[self.offsets[i]:self.offsets[i + 1]].astype(np.int64)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.tensor(int(self.labels[i]))}


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


def label_names(dataset, column: str) -> list[str]:
    feature = dataset.features[column]
    if hasattr(feature, "names"):  # datasets.ClassLabel
        return list(feature.names)
    values = set(iter_column(dataset, column))
    if all(isinstance(v, (int, np.integer)) for v in values):
        return [str(i) for i in range(max(values) + 1)]
    return sorted(str(v) for v in values)


def _cached(path: Path, build) -> dict[str, np.ndarray]:
    """Arrays stored at `path` (.npz), built and written on the first call."""
    if path.exists():
        with np.load(path) as stored:
            return dict(stored)
    arrays = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(arrays)}.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)  # atomic: concurrent ranks never read half a file
    return arrays


def _encode_labeled(dataset, text_column, label_column, names, tokenizer, max_length) -> dict[str, np.ndarray]:
    index = {name: i for i, name in enumerate(names)}
    ids, offsets, labels = [], [0], []
    for batch in dataset.iter(batch_size=512):
        encoded = tokenizer(batch[text_column], truncation=True, max_length=max_length)["input_ids"]
        for row, label in zip(encoded, batch[label_column]):
            key = str(label)
            if key not in index:
                raise UserError(Problem("data.label_column", f"label {label!r} is not among the training labels {names}"))
            ids.extend(row)
            offsets.append(len(ids))
            labels.append(index[key])
    return {"ids": np.asarray(ids, dtype=np.int32), "offsets": np.asarray(offsets, dtype=np.int64),
            "labels": np.asarray(labels, dtype=np.int64)}


def tokenize_splits(splits: TextSplits, tokenizer, task: str, max_length: int, cache_dir: Path) -> TokenizedSplits:
    """Token ids for both splits, from the cache when the text and tokenizer are unchanged."""
    tok_hash = tokenizer_hash(tokenizer)
    columns = [splits.text_column] + ([splits.label_column] if splits.label_column else [])
    names = label_names(splits.train, splits.label_column) if splits.label_column else []

    def key(dataset) -> str:
        parts = (_TOKENS_RECIPE, task, str(max_length), tok_hash, content_hash(dataset, columns), *names)
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]

    def one(dataset):
        if dataset is None or len(dataset) == 0:
            return None
        path = Path(cache_dir) / "tokens" / f"{key(dataset)}.npz"
        if task == "causal-lm":
            arrays = _cached(path, lambda: {"ids": token_stream(iter_column(dataset, splits.text_column), tokenizer)})
            blocks = PackedBlocks(arrays["ids"], max_length)
            return blocks if len(blocks) else None
        arrays = _cached(path, lambda: _encode_labeled(dataset, splits.text_column, splits.label_column, names,
                                                       tokenizer, max_length))
        return LabeledTexts(arrays["ids"], arrays["offsets"], arrays["labels"])

    return TokenizedSplits(one(splits.train), one(splits.validation), max_length, names)
