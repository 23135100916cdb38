"""The teacher's top-k cache (`distill.top_k`, `overdrive distill-cache`): the teacher's k most likely
next tokens and their log-probabilities at every position of every row of the token cache, stored
once beside it, so a later run with the same keys distils without loading the teacher.

    <data.cache_dir>/teacher/<key>/
        meta.json                      the keys, rows per shard, the teacher's file fingerprint
        shard-00000/                   written whole (a directory renamed into place), in row order:
            digests.npy  uint8 [rows, 16]   each row's identity (a digest of its token ids)
            offsets.npy  int64 [rows + 1]   where each row's positions start
            ids.npy      int32 [positions, k]
            logprobs.npy float16 [positions, k]
        done.json                      written last: every row is there

<key> is a digest of the teacher as `distill.teacher` names it, the tokenizer, data.max_length,
distill.top_k and the token rows themselves (train and validation, in order), so other data,
another tokenizer or another k never read this entry. A writer stopped at any point leaves whole
shards only: the next `distill-cache` keeps them and continues at the first missing one.

A row is found by its digest, not its place in the data set: the loader's shuffling, the split
over processes and the micro-batch never change what a row's entry is. Shards are memory-mapped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from overdrive.data.cache import read_json
from overdrive.storage.whole_file import replace_whole

ROWS_PER_SHARD = 256


def row_digest(ids: torch.Tensor) -> bytes:
    """The identity of one row: its token ids (padding cut off)."""
    return hashlib.blake2b(ids.to(torch.int64).cpu().numpy().tobytes(), digest_size=16).digest()


def row_lengths(batch: dict) -> list[int]:
    """Each row's real tokens: the attention mask's (the chat collator right-pads), or all of them."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum(-1).tolist()
    return [batch["input_ids"].shape[1]] * batch["input_ids"].shape[0]


def dataset_rows(datasets: Iterable[Any]) -> Iterable[dict]:
    """The samples of the data sets (train, then validation), in order, as the collator takes them."""
    for dataset in datasets:
        if dataset is not None:
            for i in range(len(dataset)):
                yield dataset[i]


def digest_of(sample: dict) -> bytes:
    return row_digest(torch.as_tensor(sample["input_ids"]))


def teacher_fingerprint(teacher: str) -> Optional[str]:
    """The teacher directory's config and weight files (names, sizes, mtimes); None for a hub name."""
    root = Path(teacher).expanduser()
    if not root.is_dir():
        return None
    seen = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in root.iterdir()
                  if p.is_file() and (p.suffix in (".safetensors", ".bin") or p.name == "config.json"))
    return hashlib.sha256(repr(seen).encode()).hexdigest()


def entry(cache_dir: Path, teacher: str, tokenizer_hash: str, max_length: int, top_k: int,
          digests: list[bytes]) -> Path:
    """The cache directory of these keys (the rows' digests, in order, are the data's identity)."""
    key = hashlib.sha256()
    key.update(json.dumps([teacher, tokenizer_hash, max_length, top_k]).encode())
    for d in digests:
        key.update(d)
    return Path(cache_dir).expanduser() / "teacher" / key.hexdigest()[:32]


def complete(path: Path) -> bool:
    return (path / "done.json").exists()


def write(path: Path, rows: list[dict], score: Callable[[list[dict]], list[tuple]],
          meta: dict, batch_rows: int, show: Callable[[str], None]) -> int:
    """Every row's top-k, `score(rows)` giving (ids [n, k], logprobs [n, k]) per row of a batch, in
    whole shards; shards already there are kept. The shards written by this call."""
    path.mkdir(parents=True, exist_ok=True)
    replace_whole(path / "meta.json", json.dumps({**meta, "rows": len(rows), "rows_per_shard": ROWS_PER_SHARD}))
    shards = (len(rows) + ROWS_PER_SHARD - 1) // ROWS_PER_SHARD
    written = 0
    for s in range(shards):
        target = path / f"shard-{s:05d}"
        if target.exists():
            continue
        part = rows[s * ROWS_PER_SHARD:(s + 1) * ROWS_PER_SHARD]
        scored = []
        for start in range(0, len(part), batch_rows):
            scored += score(part[start:start + batch_rows])
        partial = path / f".partial-{s:05d}-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        np.save(partial / "digests.npy", np.frombuffer(b"".join(digest_of(r) for r in part), np.uint8).reshape(-1, 16))
        np.save(partial / "offsets.npy", np.cumsum([0] + [len(r["input_ids"]) for r in part]).astype(np.int64))
        np.save(partial / "ids.npy", np.concatenate([i.cpu().numpy().astype(np.int32) for i, _ in scored]))
        np.save(partial / "logprobs.npy", np.concatenate([v.cpu().to(torch.float16).numpy() for _, v in scored]))
        os.replace(partial, target)  # a shard is there whole or not at all
        written += 1
        show(f"shard {s + 1}/{shards} ({min((s + 1) * ROWS_PER_SHARD, len(rows))}/{len(rows)} rows)")
    replace_whole(path / "done.json", json.dumps({"rows": len(rows), "shards": shards}), durable=True)
    return written


class TeacherCache:
    """The stored top-k of a complete entry, looked up by row."""

    def __init__(self, path: Path):
        self.path, self.meta = path, read_json(path / "meta.json") or {}
        self.where: dict[bytes, tuple[int, int, int]] = {}  # digest -> (shard, start, end)
        self.shards = []
        done = read_json(path / "done.json")  # a complete entry (complete(path)) has it
        if done is None:
            raise FileNotFoundError(f"{path}: not a complete teacher cache (no done.json)")
        for s in range(done["shards"]):
            shard = path / f"shard-{s:05d}"
            offsets = np.load(shard / "offsets.npy")
            for i, d in enumerate(np.load(shard / "digests.npy")):
                self.where[d.tobytes()] = (s, int(offsets[i]), int(offsets[i + 1]))
            self.shards.append((np.load(shard / "ids.npy", mmap_mode="r"), np.load(shard / "logprobs.npy", mmap_mode="r")))

    def lookup(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [B, T, k] int64, logprobs [B, T, k] float32) of a micro-batch's rows; padding: id 0, log-prob 0."""
        ids = batch["input_ids"]
        k = int(self.meta["top_k"])
        out_ids = torch.zeros((*ids.shape, k), dtype=torch.int64)
        out_lp = torch.zeros((*ids.shape, k), dtype=torch.float32)
        for row, n in enumerate(row_lengths(batch)):
            found = self.where.get(row_digest(ids[row, :n]))
            if found is None:
                raise KeyError("a row of the batch is not in the teacher's top-k cache")
            s, start, end = found
            out_ids[row, :n] = torch.from_numpy(np.asarray(self.shards[s][0][start:end], dtype=np.int64))
            out_lp[row, :n] = torch.from_numpy(np.asarray(self.shards[s][1][start:end], dtype=np.float32))
        return out_ids.to(ids.device), out_lp.to(ids.device)
