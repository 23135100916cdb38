"""Raw rows: `load_splits(cfg)` gives the train and validation rows as `datasets.Dataset`s.

From the Python standard library (`stdlib`, no download), a local file or directory, a
`save_to_disk` directory, or a hub name (the same `load_dataset` call serves a hub name and
a local copy of a hub repository).
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

# Directories of the standard library left out of the embedded corpus: tests are a third of
# the source and mostly repetitive fixtures; site-packages is not the standard library.
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".py": "text", ".json": "json",
             ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}


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
