"""Where the text comes from: `open_splits(cfg)` gives the train (and validation) corpus, unread.

A corpus is read batch by batch, never whole: plain text files (and the embedded `stdlib`
corpus) in bounded pieces (pieces.py); jsonl, csv and parquet files through `datasets` in
streaming mode (no Arrow copy of the file); a `save_to_disk` directory and a hub data set
(or a local directory laid out like one) through `datasets` as a memory-mapped table, or
streamed with `data.streaming`.

Each corpus has a key that changes with its content without reading it all: files by name,
size, modification time and sampled chunks; the standard library by its file list; a
`datasets` table by its own fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from overdrive.config.schema import RunConfig
from overdrive.data import pieces
from overdrive.errors import Problem, UserError

# Directories of the standard library left out of the embedded corpus: tests are a third of
# the source and mostly repetitive fixtures; site-packages is not the standard library.
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
_BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".py": "text", ".json": "json",
             ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}
BATCH_BYTES = 1 << 20  # text per batch handed to the tokenizer (split over its threads)
_ROWS_PER_READ = 64


@dataclass
class Batch:
    """Pieces of text (documents, or pieces of a long document) and where reading resumes after them."""

    texts: list[str]
    sizes: list[int]  # bytes of text per piece
    ends: list[bool]  # a document ends after the piece
    labels: Optional[list] = None
    position: dict = field(default_factory=dict)
    advance: float = 0.0  # progress, in the corpus' unit


class TextFiles:
    """Plain text files, each one document, read in pieces (see pieces.py)."""

    unit = "bytes"

    def __init__(self, paths: list[Path], key: str):
        self.paths, self.key = paths, key
        self.total = sum(p.stat().st_size for p in paths)
        self.label_names: Optional[list[str]] = None

    def batches(self, start: Optional[dict] = None, batch_bytes: int = BATCH_BYTES) -> Iterator[Batch]:
        batch = Batch([], [], [])
        for text, position, end, raw in pieces.iter_file_pieces(self.paths, start):
            batch.texts.append(text)
            batch.sizes.append(raw)
            batch.ends.append(end)
            batch.position, batch.advance = position, batch.advance + raw
            if sum(batch.sizes) >= batch_bytes:
                yield batch
                batch = Batch([], [], [])
        if batch.texts:
            yield batch


class Rows:
    """Rows of a `datasets` Dataset or IterableDataset: one document (and label) per row."""

    unit = "rows"

    def __init__(self, dataset, key: str, text_column: str, label_column: Optional[str],
                 total: Optional[int] = None, label_names: Optional[list[str]] = None, files: Sequence[Path] = ()):
        self.dataset, self.key, self.text_column, self.label_column = dataset, key, text_column, label_column
        self.total, self.label_names, self.files = total, label_names, tuple(files)

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Reads of the rows inside: a byte of a local file that is not UTF-8 (met only as the stream
        decodes its rows, so not looked for up front) said by its file and line."""
        try:
            yield
        except UnicodeDecodeError:
            from overdrive.data.row_table import undecodable

            found = next(filter(None, (undecodable(f, str(f)) for f in self.files)), None)
            if found is None:
                raise
            raise UserError(found) from None

    def column_names(self) -> list[str]:
        with self.reading():  # a stream's first row is read for them
            return _columns(self.dataset)

    def batches(self, start: Optional[dict] = None, batch_bytes: int = BATCH_BYTES) -> Iterator[Batch]:
        with self.reading():
            yield from self._batches(start, batch_bytes)

    def _batches(self, start: Optional[dict], batch_bytes: int) -> Iterator[Batch]:
        done = (start or {}).get("rows", 0)
        dataset = self.dataset.skip(done) if done else self.dataset
        batch = Batch([], [], [], [] if self.label_column else None)
        for rows in dataset.iter(batch_size=_ROWS_PER_READ):
            texts = ["" if t is None else str(t) for t in rows[self.text_column]]
            batch.texts += texts
            batch.sizes += [len(t.encode("utf-8", errors="replace")) for t in texts]
            batch.ends += [True] * len(texts)
            if self.label_column:
                batch.labels += rows[self.label_column]
            done += len(texts)
            batch.position, batch.advance = {"rows": done}, batch.advance + len(texts)
            if sum(batch.sizes) >= batch_bytes or len(batch.texts) >= 1024:
                yield batch
                batch = Batch([], [], [], [] if self.label_column else None)
        if batch.texts:
            yield batch


def holdout_fraction(cfg: RunConfig) -> float:
    """The share of the train split held out for validation: none with a validation split of its
    own, and none for RL's prompts (data/prompts.py reads them whole: an RL run has no validation)."""
    d = cfg.data
    if d.format == "prompts" or d.validation_split:
        return 0.0
    return d.validation_fraction


@dataclass
class Splits:
    """The corpora of a run and how validation is taken from them."""

    train: Any  # TextFiles | Rows
    validation: Optional[Any]  # a separate validation split, when data.validation_split is set
    holdout: float  # fraction of the train corpus held out for validation (0 with a separate split)
    seed: int
    max_bytes: Optional[int]
    label_column: Optional[str]

    def train_key(self) -> str:
        """The training text's identity: the corpus, the hold-out and the byte limit."""
        return hashlib.sha256(f"{self.train.key}|{self.holdout}|{self.seed}|{self.max_bytes}".encode()).hexdigest()


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


def stdlib_corpus(max_bytes: Optional[int] = None) -> TextFiles:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(max_bytes, root)
    # Keyed by its file list (names, sizes, times): the same Python gives the same corpus.
    key = f"stdlib|{sys.version}|" + pieces.files_fingerprint(files, root, sample=False)
    return TextFiles(files, key)


def _builder_for(path: Path, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    builder = _BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise UserError(Problem("data.format", f"cannot tell the format of {path.name} from its extension",
                                fix="set data.format to text, json, csv or parquet"))
    return builder


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


def _files_under(path: Path, builder: str) -> list[Path]:
    if path.is_file():
        return [path]
    wanted = {s for s, b in _BUILDERS.items() if b == builder}
    return sorted(p for p in path.rglob("*") if p.is_file() and (builder == "text" or p.suffix.lower() in wanted))


def _columns(dataset) -> list[str]:
    names = dataset.column_names
    if names is None:  # a stream whose features are not known until read: look at the first row
        names = list(next(iter(dataset.take(1)), {}).keys())
    return list(names)


def _label_names(dataset, label_column: Optional[str]) -> Optional[list[str]]:
    feature = (dataset.features or {}).get(label_column) if label_column else None
    return list(feature.names) if hasattr(feature, "names") else None


def _text_cells(files: list[Path], delimiter: str) -> dict:
    """CSV cells read as the text they are: pandas would read an answer `007` as the number 7 and `2024-01`
    as a date, which no reward, chat template or pair compares equal to what the file says."""
    import csv

    import datasets

    with files[0].open(newline="", encoding="utf-8-sig", errors="replace") as f:
        header = next(csv.reader(f, delimiter=delimiter), [])
    return {"features": datasets.Features({name: datasets.Value("string") for name in header})} if header else {}


def _row_files(files: list[Path], builder: str, text_column, label_column, cache_dir: Path,
               text_cells: bool = False) -> Rows:
    """`text_cells`: rows of text (chat, pairs, prompts), a CSV's cells kept as written."""
    import datasets

    blank = next((f for f in files if f.stat().st_size < 1 << 16 and not f.read_bytes().strip()), None)
    if blank is not None:  # datasets cannot tell the columns of a file without a row: its error names nothing
        raise UserError(Problem("data.source", f"{blank} has no rows (the file is empty)",
                                fix="write the rows into it, or leave it out"))
    kwargs = {"delimiter": "\t"} if builder == "csv" and files[0].suffix.lower() == ".tsv" else {}
    typed = _text_cells(files, kwargs.get("delimiter", ",")) if builder == "csv" and text_cells else {}
    stream = datasets.load_dataset(builder, data_files={"train": [str(f) for f in files]}, split="train",
                                   streaming=True, cache_dir=str(cache_dir), **kwargs, **typed)
    if builder == "parquet":
        import pyarrow.parquet as pq

        total = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    else:
        total = pieces.estimate_lines(files) if builder in ("json", "csv") else None
        if builder == "csv" and total:
            total -= len(files)  # header lines
    key = f"{builder}|{json.dumps(kwargs)}|{'text cells|' if typed else ''}" + pieces.files_fingerprint(files)
    return Rows(stream, key, text_column, label_column, total, files=files)


def _table(dataset, what: str, text_column, label_column) -> Rows:
    """A map-style `datasets.Dataset` (memory-mapped Arrow) or a stream of one."""
    import datasets

    if isinstance(dataset, datasets.IterableDataset):
        info = dataset.info
        head = [json.dumps(r, sort_keys=True, default=str) for r in dataset.take(100)]
        key = hashlib.sha256(f"{what}|{info.dataset_name}|{info.config_name}|{info.version}|{head}".encode())
        split = (info.splits or {}).get(str(dataset.split)) if info.splits else None
        return Rows(dataset, "stream|" + key.hexdigest(), text_column, label_column,
                    getattr(split, "num_examples", None) or None, _label_names(dataset, label_column))
    return Rows(dataset, f"table|{dataset._fingerprint}", text_column, label_column, len(dataset),
                _label_names(dataset, label_column))


def _load(source: str, subset, split: str, streaming: bool, cache_dir: Path, key: str):
    import datasets

    from overdrive import hub

    try:
        with hub.reading("data.source", source, what="data set", revision_key="data.source",
                         cache=str(cache_dir)):
            return datasets.load_dataset(source, name=subset, split=split, streaming=streaming,
                                         cache_dir=str(cache_dir))
    except ValueError as error:
        if "split" in str(error).lower():
            raise UserError(Problem(key, str(error), fix=f"set {key} to a split the data has")) from error
        raise UserError(Problem("data.source", f"could not load {source!r}: {error}")) from error
    except (FileNotFoundError, ConnectionError, OSError) as error:
        raise UserError(Problem("data.source", f"could not load {source!r}: {error}",
                                fix="give a local file or directory, a save_to_disk output, or a hub data "
                                "set name (hub names need network access or a filled cache)")) from error


def read_source(cfg: RunConfig, split: str, key: str):
    """The corpus of one split of `data.source`, as stored (text files or rows)."""
    d = cfg.data
    label = d.label_column if cfg.model.task == "sequence-classification" else None
    if d.source == "stdlib":
        return stdlib_corpus(d.max_bytes)
    cache = Path(d.cache_dir).expanduser() / "datasets"
    path = Path(d.source).expanduser()
    if _is_saved_dataset(path):
        import datasets

        saved = _pick(datasets.load_from_disk(str(path)), split, key)
        return _table(saved, str(path), d.text_column, label)
    if path.is_file() or (path.is_dir() and d.format not in ("auto", "chat", "preference", "prompts")):
        builder = _builder_for(path, "auto" if d.format in ("chat", "preference", "prompts") else d.format)
        files = _files_under(path, builder)
        if not files:
            raise UserError(Problem("data.source", f"no {builder} files under {path}"))
        if builder == "text":
            return TextFiles(files, "text|" + pieces.files_fingerprint(files))
        return _row_files(files, builder, d.text_column, label, cache, d.format in ("chat", "preference", "prompts"))
    # A hub name, or a local directory laid out like a hub repository (data files whose
    # names give the splits): `load_dataset` treats both the same way.
    name = str(path) if path.is_dir() else d.source
    return _table(_load(name, d.subset, split, d.streaming, cache, key), name, d.text_column, label)


def row_batches(dataset: Any, columns: list[str], make: Any, start: Optional[dict] = None,
                batch_bytes: int = 1 << 20) -> Iterator["Batch"]:
    """A table's rows read 64 at a time, each made into one record by `make(row, index)` (a
    conversation, a preference pair), in batches of about `batch_bytes`; a batch's position is the
    rows done, so tokenizing resumes after the last whole batch."""
    done = (start or {}).get("rows", 0)
    rows_left = dataset.skip(done) if done else dataset
    batch = Batch([], [], [])
    for rows in rows_left.iter(batch_size=64):
        n = len(rows[columns[0]])
        for i in range(n):
            record = make({c: rows[c][i] for c in columns}, done + i)
            batch.texts.append(record)
            batch.sizes.append(len(json.dumps(record).encode()))
            batch.ends.append(True)
        done += n
        batch.position, batch.advance = {"rows": done}, batch.advance + n
        if sum(batch.sizes) >= batch_bytes or len(batch.texts) >= 1024:
            yield batch
            batch = Batch([], [], [])
    if batch.texts:
        yield batch
