"""Token ids: a corpus through the tokenizer, batch by batch, into the token cache (cache.py).

The fast tokenizer encodes each batch of pieces on all cores (its batch encoding runs in
Rust threads, without the GIL), while this thread turns the previous batch into arrays and
appends them: memory stays at about two batches whatever the size of the corpus.

Validation is held out by piece (a document, or a piece of a long text file): piece i goes
to validation when a hash of (seed, i) falls under `data.validation_fraction`. The choice
depends on the seed and the index alone, so it needs no shuffle of the whole corpus and a
resumed tokenization makes the same choices.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from overdrive.data import cache
from overdrive.data.chat_samples import open_chat
from overdrive.data.samples import LabeledTexts, PackedBlocks
from overdrive.errors import Problem, UserError

_TOKENS_RECIPE = "tokens-v2"  # bump when tokenization or the cache layout changes: old entries are not misread


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


def held_out(seed: int, index: int, fraction: float) -> bool:
    """Piece `index` belongs to validation: a fixed function of the seed and the index."""
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def id_dtype(tokenizer) -> str:
    return "uint16" if len(tokenizer) <= np.iinfo(np.uint16).max else "int32"


class Encoder:
    """Texts -> lists of ids: raw ids for a causal LM; truncated, with special tokens, for a classifier."""

    def __init__(self, tokenizer, task: str, max_length: int):
        self.tokenizer, self.task, self.max_length = tokenizer, task, max_length
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self.task == "causal-lm":
            if self.backend is not None:  # all cores; no offsets or attention masks built
                return [e.ids for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]


def _encoded(batches: Iterable, encode: Callable) -> Iterator[tuple]:
    """(batch, ids) with the next batch already encoding in a thread."""
    with ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
        pending: deque = deque()
        for batch in batches:
            pending.append((batch, pool.submit(encode, batch.texts)))
            if len(pending) >= 2:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


class LabelTable:
    """Label values -> class indices. Fixed names (a ClassLabel, or the training split's) map
    directly; otherwise classes are numbered as first seen and renumbered at the end, as
    range(max + 1) for integer labels and in sorted order for any other."""

    def __init__(self, names: Optional[list[str]], seen: Optional[list] = None, integer_values: bool = False):
        self.fixed = names is not None
        self.names = list(names) if names is not None else [str(k) for k in (seen or [])]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.integer_values = integer_values  # a ClassLabel stores the index itself

    def code(self, value) -> int:
        if self.integer_values and isinstance(value, (int, np.integer)):
            return int(value)
        key = str(value)
        if key not in self.index:
            if self.fixed:
                raise UserError(Problem("data.label_column",
                                        f"label {value!r} is not among the training labels {self.names}"))
            self.index[key] = len(self.names)
            self.names.append(key)
        return self.index[key]

    def final(self) -> tuple[list[str], np.ndarray]:
        """The class names and the map from codes as stored to their final index."""
        if self.fixed:
            return self.names, np.arange(len(self.names), dtype=np.int32)
        if all(n.lstrip("-").isdigit() for n in self.names) and self.names:
            values = [int(n) for n in self.names]
            return [str(i) for i in range(max(values) + 1)], np.asarray(values, dtype=np.int32)
        ordered = sorted(self.names)
        return ordered, np.asarray([ordered.index(n) for n in self.names], dtype=np.int32)


def entry_key(corpus_key: str, task: str, max_length: int, tokenizer, holdout: float, seed: int,
              max_bytes: Optional[int], names: Optional[list[str]]) -> str:
    # Packed blocks are cut when read, so a causal LM's entry serves every data.max_length.
    length = str(max_length) if task != "causal-lm" else "-"
    parts = (_TOKENS_RECIPE, task, length, tokenizer_hash(tokenizer), corpus_key, str(holdout), str(seed),
             str(max_bytes), repr(names))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def fill(entry: Path, corpus, encoder: Encoder, holdout: float, seed: int, max_bytes: Optional[int],
         names: Optional[list[str]], progress) -> dict:
    """Tokenize `corpus` into `entry`, continuing where an interrupted writer stopped."""
    labeled = encoder.task == "sequence-classification"
    writer = cache.EntryWriter(entry, id_dtype(encoder.tokenizer), labeled, getattr(encoder, "kinds", None))
    state = writer.progress
    table = LabelTable(names, state.get("labels"), integer_values=names is not None and corpus.label_names is not None)
    index, seen, resumed = state.get("pieces", 0), state.get("bytes", 0), state.get("bytes", 0)
    advanced = state.get("advance", 0)
    started = time.perf_counter()
    if writer.position is not None and writer.position.get("end"):
        batches = iter(())  # the reading finished; only the closing step was interrupted
    else:
        batches = corpus.batches(writer.position)
    progress.resume_at(advanced)
    try:
        for batch, ids in _encoded(batches, encoder):
            n = len(batch.texts)
            stop = False
            if max_bytes is not None:
                cumulative = np.cumsum(batch.sizes) + seen
                over = np.nonzero(cumulative >= max_bytes)[0]
                if len(over):
                    n, stop = int(over[0]) + 1, True
            parts = {"train": [], "validation": []}
            for i in range(n):
                parts["validation" if held_out(seed, index + i, holdout) else "train"].append(i)
            for part, rows in parts.items():
                if rows:
                    _append(writer, part, rows, batch, ids, encoder, table)
            index += n
            seen += sum(batch.sizes[:n])
            advanced += batch.advance
            position = {"end": True} if stop else batch.position
            writer.record(position, pieces=index, bytes=seen, labels=None if table.fixed else table.names,
                          advance=advanced)
            progress.advance(batch.advance, sum(batch.sizes[:n]))
            if stop:
                break
        final_names = []
        if labeled:
            final_names, remap = table.final()
            writer.close()
            _renumber(entry, writer, remap)
        meta = {"pieces": index, "text_bytes": seen, "label_names": final_names, "resumed_from_bytes": resumed,
                "seconds": time.perf_counter() - started,
                "counts": {f"{p}.{k}": writer.count(p, k) for p in cache.PARTS for k in writer.kinds}}
        if hasattr(encoder, "summary"):  # chat: conversations truncated and dropped
            meta.update(encoder.summary())
        writer.finish(meta)
        return meta
    finally:
        writer.close()


def _append(writer: cache.EntryWriter, part: str, rows: list[int], batch, ids: list[list[int]], encoder: Encoder,
            table: LabelTable) -> None:
    flat: list[int] = []
    if encoder.task in ("chat", "preference"):  # ids, loss mask and ends: chat.py, preference.py
        encoder.append(writer, part, rows, ids)
        return
    if encoder.task == "causal-lm":
        for i in rows:
            flat.extend(ids[i])
            if batch.ends[i] and encoder.eos is not None:
                flat.append(encoder.eos)
        writer.append(part, np.asarray(flat, dtype=writer.dtype))
        return
    base, ends = writer.count(part), []
    for i in rows:
        flat.extend(ids[i])
        ends.append(base + len(flat))
    labels = np.asarray([table.code(batch.labels[i]) for i in rows], dtype=np.int32)
    writer.append(part, np.asarray(flat, dtype=writer.dtype), np.asarray(ends, dtype=np.int64), labels)


def _renumber(entry: Path, writer: cache.EntryWriter, remap: np.ndarray, chunk: int = 1 << 22) -> None:
    """Stored first-seen codes -> final class indices, in place, a chunk at a time."""
    if np.array_equal(remap, np.arange(len(remap))):
        return
    for part in cache.PARTS:
        count = writer.count(part, "labels")
        if count:
            labels = np.memmap(entry / f"{part}.labels", dtype=np.int32, mode="r+", shape=(count,))
            for start in range(0, count, chunk):
                labels[start:start + chunk] = remap[labels[start:start + chunk]]
            labels.flush()
            del labels


def open_entry(entry: Path, task: str, max_length: int, packing: bool = False,
               pad_id: int = 0, document_end: Optional[int] = None) -> dict[str, Optional[torch.utils.data.Dataset]]:
    """The entry's parts as datasets over memory maps; raises cache.NotReady until it is complete.
    `task` is `chat` for chat data (data/chat.py), whose conversations are packed with `packing`.
    `document_end`: the id text documents were joined with, set under `data.document_mask` (samples.py)."""
    meta = cache.done(entry)
    if meta is None:
        raise cache.NotReady(str(entry))
    counts, dtype = meta["counts"], np.dtype(meta["dtype"])
    result: dict[str, Optional[torch.utils.data.Dataset]] = {}
    for part in cache.PARTS:
        ids = cache.open_array(entry, f"{part}.ids", dtype, counts[f"{part}.ids"])
        if task == "causal-lm":
            blocks = PackedBlocks(ids, max_length, document_end)
            result[part] = blocks if len(blocks) else None
        elif task == "preference":  # pairs: two conversations each (preference_samples.py)
            from overdrive.data.preference_samples import open_pairs

            n = counts[f"{part}.ends"]
            result[part] = open_pairs(ids, cache.open_array(entry, f"{part}.ends", np.int64, n),
                                      cache.open_array(entry, f"{part}.mask", np.uint8, counts[f"{part}.mask"]))
        elif task == "unpaired":  # KTO's rows: the label in the completion's mask (preference_unpaired.py)
            from overdrive.data.preference_unpaired import open_unpaired

            n = counts[f"{part}.ends"]
            result[part] = open_unpaired(ids, cache.open_array(entry, f"{part}.ends", np.int64, n),
                                         cache.open_array(entry, f"{part}.mask", np.uint8, counts[f"{part}.mask"]))
        elif task == "chat":
            n = counts[f"{part}.ends"]
            result[part] = open_chat(ids, cache.open_array(entry, f"{part}.ends", np.int64, n),
                                     cache.open_array(entry, f"{part}.mask", np.uint8, counts[f"{part}.mask"]),
                                     max_length, packing, pad_id)
        else:
            n = counts[f"{part}.labels"]
            result[part] = LabeledTexts(ids, cache.open_array(entry, f"{part}.ends", np.int64, n),
                                        cache.open_array(entry, f"{part}.labels", np.int32, n)) if n else None
    return result
