"""The token cache: one directory per (text, tokenizer, recipe), written once, read memory-mapped.

    <cache_dir>/tokens/<key>/
        train.ids  validation.ids         token ids, appended batch by batch (uint16 or int32)
        train.ends validation.ends        classification: int64 end offset of each row's ids
        train.labels validation.labels    classification: int32 class index of each row
        train.mask validation.mask        chat: uint8 loss mask per token (ends: each conversation's end)
        progress.json                     how far the writer got (lengths of every file, read position)
        done.json                         written last: the entry is complete (counts, dtype, label names)
        lock                              held (flock) by the one process writing

A writer killed at any point leaves files at least as long as progress.json says; the next
writer truncates them to those lengths and continues reading from the recorded position.
Readers open only entries with done.json, as `numpy.memmap`: every process on a machine
shares the same pages instead of holding its own copy.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from overdrive.storage.lock import exclusive
from overdrive.storage.whole_file import replace_whole

PARTS = ("train", "validation")


class NotReady(Exception):
    """A cache another process is still writing (or has not started): wait, then ask again."""


def _write_json(path: Path, value: dict) -> None:
    replace_whole(path, json.dumps(value), durable=True)  # a reader sees the old record or the new one, never half


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


@contextmanager
def writing(entry: Path) -> Iterator[bool]:
    """Hold the entry's lock; yields False when another writer completed it meanwhile."""
    with exclusive(entry / "lock"):  # another process (or machine on a shared disk) may be writing it
        yield not (entry / "done.json").exists()


class EntryWriter:
    """Appends ids (and row ends and labels) per part, recording progress after each batch."""

    def __init__(self, entry: Path, dtype: str, labeled: bool, kinds: Optional[tuple[str, ...]] = None):
        self.entry, self.dtype, self.labeled = entry, np.dtype(dtype), labeled
        self.kinds = kinds or (("ids", "ends", "labels") if labeled else ("ids",))
        entry.mkdir(parents=True, exist_ok=True)
        self.progress = read_json(entry / "progress.json") or {}
        if self.progress.get("dtype", dtype) != dtype:
            self.progress = {}
        self.lengths = {name: 0 for name in self._names()}
        self.lengths.update(self.progress.get("lengths", {}))
        self.files = {}
        for name, length in self.lengths.items():
            path = entry / name
            path.touch()
            with open(path, "r+b") as f:
                f.truncate(length)  # drop what was written after the last progress record
            self.files[name] = open(path, "ab")

    def _names(self) -> list[str]:
        return [f"{part}.{kind}" for part in PARTS for kind in self.kinds]

    @property
    def position(self) -> Optional[dict]:
        return self.progress.get("position")

    def count(self, part: str, kind: str = "ids") -> int:
        size = {"ids": self.dtype.itemsize, "ends": 8, "labels": 4, "mask": 1}[kind]
        return self.lengths[f"{part}.{kind}"] // size

    def append(self, part: str, ids: np.ndarray, ends: Optional[np.ndarray] = None,
               labels: Optional[np.ndarray] = None, mask: Optional[np.ndarray] = None) -> None:
        for kind, values in (("ids", ids.astype(self.dtype, copy=False)), ("ends", ends), ("labels", labels),
                             ("mask", mask)):
            if values is None:
                continue
            name = f"{part}.{kind}"
            data = values.tobytes()
            self.files[name].write(data)
            self.lengths[name] += len(data)

    def record(self, position: dict, **extra) -> None:
        """Make what was appended durable, then say so: data first, the record after."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        self.progress = {**self.progress, **extra, "dtype": self.dtype.name, "lengths": dict(self.lengths),
                         "position": position}
        _write_json(self.entry / "progress.json", self.progress)

    def finish(self, meta: dict) -> None:
        self.close()
        _write_json(self.entry / "done.json", {**meta, "dtype": self.dtype.name, "lengths": self.lengths})
        (self.entry / "progress.json").unlink(missing_ok=True)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def open_array(entry: Path, name: str, dtype, count: int) -> np.ndarray:
    """A read-only memory map of `count` items (an empty array for an empty file: mmap refuses those)."""
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(entry / name, dtype=dtype, mode="r", shape=(count,))


def done(entry: Path) -> Optional[dict]:
    return read_json(entry / "done.json")


ASIDE_PREFIX = ".corrupt-"


def damage(entry: Path) -> Optional[str]:
    """Why an entry that says it is complete cannot be read (done.json unreadable, a file
    missing or of another length than it records), else None."""
    if not (entry / "done.json").exists():
        return None
    meta = done(entry)
    if meta is None or not isinstance(meta.get("lengths"), dict):
        return "done.json is unreadable"
    for name, length in sorted(meta["lengths"].items()):
        try:
            size = (entry / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != length:
            return f"{name} has {size} bytes, done.json says {length}"
    return None


def set_aside(entry: Path) -> Optional[Path]:
    """Move a damaged entry out of the way (one kept per key, for a look); None when it cannot
    be moved (a read-only cache), and then it is rebuilt nowhere: the caller says so."""
    import shutil

    target = entry.with_name(f"{ASIDE_PREFIX}{entry.name}")
    try:
        if target.exists():
            shutil.rmtree(target)
        os.replace(entry, target)
    except OSError:
        return None
    return target


def entry_bytes(entry: Path) -> int:
    return sum(p.stat().st_size for p in entry.iterdir() if p.is_file())
