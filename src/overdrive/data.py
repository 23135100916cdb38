"""Data: raw text through `datasets`, token ids cached by content hash, DataLoaders.

Three steps, each a plain function:

1. `load_splits(cfg)`: the train and validation rows as `datasets.Dataset`s, from the
   Python standard library (`stdlib`, no download), a local file or directory, a
   `save_to_disk` directory, or a hub name (the same `load_dataset` call serves a hub name
   and a local copy of a hub repository).
2. `tokenize_splits(...)`: token ids, stored as numpy arrays under `<cache_dir>/tokens/`
   keyed by a hash of the text and of the tokenizer, so a second run skips tokenizing.
3. `train_loader(...)` / `eval_loader(...)`: DataLoaders. The training loader uses whole
   global batches only, so every optimizer step sees exactly micro x accumulation x world
   samples, also at the end of an epoch.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import torch

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

# Directories of the standard library left out of the embedded corpus: tests are a third of
# the source and mostly repetitive fixtures; site-packages is not the standard library.
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".py": "text", ".json": "json",
             ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
_TOKENS_RECIPE = "tokens-v1"  # bump when tokenization changes, to invalidate the cache


# ---------------------------------------------------------------- 1. raw rows

@dataclass
class TextSplits:
    """Raw rows: `text_column` (and `label_column` for classification) in each split."""

    train: "object"  # datasets.Dataset
    validation: Optional["object"]
    text_column: str
    label_column: Optional[str] = None


def stdlib_files(max_bytes: Optional[int] = None, root: Optional[Path] = None) -> list[Path]:
    """The standard library's .py files, sorted (the corpus is the same on every run)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if _STDLIB_SKIP.intersection(path.relative_to(root).parts[:-1]):
            continue
        files.append(path)
        total += path.stat().st_size
        if max_bytes is not None and total >= max_bytes:
            break
    return files


def load_stdlib(max_bytes: Optional[int] = None, root: Optional[Path] = None):
    import datasets

    files = stdlib_files(max_bytes, root)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    return datasets.Dataset.from_dict({"text": texts})


def _builder_for(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(Problem("data.format", f"cannot tell the format of {path.name} from its extension",
                                fix="set data.format to text, json, csv or parquet"))
    return builder


def _builder_kwargs(builder: str, path: Path) -> dict:
    if builder == "text":
        # One row per file: a language model wants documents, not lines.
        return {"sample_by": "document"}
    if builder == "csv" and path.suffix.lower() == ".tsv":
        return {"delimiter": "\t"}
    return {}


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in ("dataset_dict.json", "state.json"))


def _pick(dataset, split: Optional[str], key: str):
    """One split from what a loader returned (a Dataset or a DatasetDict)."""
    if split is None or not hasattr(dataset, "keys"):
        return dataset
    if split not in dataset:
        raise UserError(Problem(key, f"no split {split!r}; the data has {sorted(dataset.keys())}",
                                fix=f"set {key} to one of those"))
    return dataset[split]


def load_source(source: str, fmt: str = "auto", subset: Optional[str] = None, split: str = "train",
                validation_split: Optional[str] = None, cache_dir: Optional[Path] = None,
                max_bytes: Optional[int] = None):
    """(train, validation or None) rows for `data.source`."""
    import datasets

    if source == "stdlib":
        return load_stdlib(max_bytes), None
    path = Path(source).expanduser()
    if _is_saved_dataset(path):
        saved = datasets.load_from_disk(str(path))
        validation = _pick(saved, validation_split, "data.validation_split") if validation_split else None
        return _pick(saved, split, "data.split"), validation
    if path.is_file() or (path.is_dir() and fmt != "auto"):
        builder = _builder_for(path, fmt)
        files = str(path) if path.is_file() else str(path / "**")
        args, kwargs = (builder,), {"data_files": {"train": files}, **_builder_kwargs(builder, path)}
    else:
        # A hub name, or a local directory laid out like a hub repository (data files whose
        # names give the splits): `load_dataset` treats both the same way.
        args, kwargs = (str(path) if path.is_dir() else source,), {"name": subset}

    def load(which: str, key: str):
        try:
            return datasets.load_dataset(*args, split=which, cache_dir=str(cache_dir) if cache_dir else None, **kwargs)
        except ValueError as error:
            if "split" in str(error).lower():
                raise UserError(Problem(key, str(error), fix=f"set {key} to a split the data has")) from error
            raise UserError(Problem("data.source", f"could not load {source!r}: {error}")) from error
        except (FileNotFoundError, ConnectionError, OSError) as error:
            raise UserError(Problem("data.source", f"could not load {source!r}: {error}",
                                    fix="give a local file or directory, a save_to_disk output, or a hub data "
                                    "set name (hub names need network access or a filled cache)")) from error

    train = load(split, "data.split")
    return train, load(validation_split, "data.validation_split") if validation_split else None


def limit_bytes(dataset, column: str, max_bytes: Optional[int]):
    """The leading rows holding about `max_bytes` of text."""
    if max_bytes is None:
        return dataset
    total = 0
    for i, text in enumerate(iter_column(dataset, column)):
        total += len(text.encode("utf-8", errors="replace"))
        if total >= max_bytes:
            return dataset.select(range(i + 1))
    return dataset


def load_splits(cfg: RunConfig) -> TextSplits:
    """Builder: config -> raw train/validation rows."""
    d = cfg.data
    cache = Path(d.cache_dir).expanduser() / "datasets"
    train, validation = load_source(d.source, d.format, d.subset, d.split, d.validation_split, cache, d.max_bytes)
    label = d.label_column if cfg.model.task == "sequence-classification" else None
    for name, ds in (("data.text_column", d.text_column), ("data.label_column", label)):
        if ds is not None and ds not in train.column_names:
            raise UserError(Problem(name, f"no column {ds!r}; the data has {train.column_names}",
                                    fix=f"set {name} to one of those"))
    train = limit_bytes(train, d.text_column, d.max_bytes)
    if validation is None and d.validation_fraction > 0 and len(train) > 1:
        # Hold out whole documents, chosen by the seed: a token-level cut would let the
        # validation text continue a training document.
        parts = train.train_test_split(test_size=d.validation_fraction, seed=cfg.training.seed, shuffle=True)
        train, validation = parts["train"], parts["test"]
    return TextSplits(train, validation, d.text_column, label)


def iter_column(dataset, column: str, batch_size: int = 1000) -> Iterator:
    for batch in dataset.iter(batch_size=batch_size):
        yield from batch[column]


def content_hash(dataset, columns: Iterable[str]) -> str:
    """sha256 of the listed columns' values: the cache key for anything derived from them."""
    digest = hashlib.sha256()
    for column in columns:
        digest.update(f"\x00column:{column}\x00".encode())
        for value in iter_column(dataset, column):
            digest.update(str(value).encode("utf-8", errors="replace") + b"\x00")
    return digest.hexdigest()


# ---------------------------------------------------------------- 2. token ids

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


# ---------------------------------------------------------------- 3. loaders

def collate_for(task: str, pad_id: Optional[int]):
    return PadCollator(pad_id if pad_id is not None else 0) if task == "sequence-classification" else None


class EpochShuffle(torch.utils.data.Sampler):
    """The first `num_samples` indices of a permutation seeded by seed + epoch.

    Each epoch's order is a function of the seed and the epoch number alone (not of how
    many epochs this process has iterated), so a run resumed in epoch 3 sees epoch 3's
    order, and skipping into it needs only the count of batches already taken.
    """

    def __init__(self, size: int, num_samples: int, seed: int, shuffle: bool = True):
        self.size, self.num_samples, self.seed, self.shuffle = size, num_samples, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:  # called through Accelerate's DataLoader wrapper
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator)[:self.num_samples].tolist())

    def __len__(self) -> int:
        return self.num_samples


def train_loader(dataset, micro_batch_size: int, accumulation: int, world_size: int, seed: int,
                 shuffle: bool = True, num_workers: int = 0, pin_memory: bool = False, collate_fn=None):
    """Batches for training, using a whole number of global batches per epoch.

    Rounding down to a multiple of micro x accumulation x world keeps every optimizer step
    the same size: otherwise Accelerate ends the accumulation early at the end of the data
    and that step averages over fewer samples.
    """
    global_batch = micro_batch_size * accumulation * world_size
    usable = (len(dataset) // global_batch) * global_batch
    if usable == 0:
        raise UserError(Problem(
            "training.micro_batch_size",
            f"the training data has {len(dataset)} samples, fewer than one global batch "
            f"({micro_batch_size} x {accumulation} accumulation x {world_size} processes = {global_batch})",
            fix="lower training.micro_batch_size or training.gradient_accumulation_steps, or give more data"))
    sampler = EpochShuffle(len(dataset), usable, seed, shuffle)
    return torch.utils.data.DataLoader(
        dataset, batch_size=micro_batch_size, sampler=sampler, drop_last=True, num_workers=num_workers,
        pin_memory=pin_memory, collate_fn=collate_fn, persistent_workers=num_workers > 0,
        generator=_own_generator(seed))


def _own_generator(seed: int) -> torch.Generator:
    # Every new iterator draws a worker seed from the loader's generator, or from the global
    # torch RNG when it has none; dropout draws from that one, so a loader without its own
    # would shift every dropout mask after an extra iterator (a resume, an evaluation).
    return torch.Generator().manual_seed(seed)


def eval_loader(dataset, batch_size: int, num_workers: int = 0, pin_memory: bool = False, collate_fn=None):
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                                       pin_memory=pin_memory, collate_fn=collate_fn,
                                       persistent_workers=num_workers > 0,  # evaluated again and again
                                       generator=_own_generator(0))
