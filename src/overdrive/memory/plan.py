"""A run's arithmetic before launch: batch, tokens, steps, epochs, and time when measured.

Every number says what it rests on: the data size is exact only when token ids are already
cached; otherwise it is the raw text's bytes over BYTES_PER_TOKEN, and the plan says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

BYTES_PER_TOKEN = 3.5
"""Bytes of source text per token for a byte-level BPE of ~8k-50k entries on English and
code. Rough (±30%): a larger vocabulary packs more bytes into a token."""
_TEXT_SUFFIXES = {".txt", ".text", ".md", ".py", ".json", ".jsonl", ".csv", ".tsv"}


@dataclass(frozen=True)
class DataSize:
    tokens: Optional[int]
    basis: str
    exact: bool = False
    # The training samples of an epoch where a sample is not a packed block of tokens (RL's
    # completion slots, pairs, rows: data/estimate.Forecast.samples), already less any hold-out.
    samples: Optional[int] = None
    samples_basis: str = ""


def data_size(cfg: RunConfig, cached_tokens: Optional[int] = None) -> DataSize:
    """Training tokens before the validation hold-out, and how they were counted.

    `cached_tokens`: exact, from the token cache (`overdrive plan` also measures a sample:
    data/estimate.py; this is the estimate without one).
    """
    if cached_tokens:
        return DataSize(int(cached_tokens), "token ids cached by an earlier run (exact)", exact=True)
    d = cfg.data
    if d.source == "stdlib":
        from overdrive.data import stdlib_files

        files = stdlib_files(d.max_bytes)
        nbytes = sum(p.stat().st_size for p in files)
        what = f"{len(files)} standard-library .py files"
    else:
        path = Path(d.source).expanduser()
        if not path.exists():
            return DataSize(None, f"unknown: {d.source!r} is a hub data set; its size is known once it is cached "
                                  "(or bound it with data.max_bytes)")
        candidates = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        if any(p.suffix.lower() == ".parquet" for p in candidates):
            return DataSize(None, "unknown: parquet is compressed; its text size is known once tokenized")
        files = [p for p in candidates if path.is_file() or p.suffix.lower() in _TEXT_SUFFIXES]
        nbytes = sum(p.stat().st_size for p in files)
        what = f"{len(files)} file(s) under {d.source}"
    if d.max_bytes:
        nbytes = min(nbytes, d.max_bytes)
    tokens = int(nbytes / BYTES_PER_TOKEN)
    return DataSize(tokens, f"estimate: {nbytes:,} bytes of text in {what} / {BYTES_PER_TOKEN} bytes per token "
                            "(no cached token ids)")


@dataclass(frozen=True)
class Arithmetic:
    world: int
    micro_batch: int
    accumulation: int
    seq_len: int
    global_batch: int
    tokens_per_step: int
    max_steps: int
    train_tokens: Optional[int]
    steps_per_epoch: Optional[int]
    epochs: Optional[float]
    held_out: float = 0.0  # the share of the data held out for validation (0: the run has no hold-out)
    samples: Optional[int] = None  # training samples per epoch


def arithmetic(cfg: RunConfig, data: DataSize, micro_batch: int) -> Arithmetic:
    """The settled batch split (at `micro_batch`, for an `auto` one shown as an integer);
    the loader drops incomplete global batches."""
    import overdrive.config.batch as batch

    t = cfg.training
    split = batch.split(batch.with_split(cfg, micro_batch, t.gradient_accumulation_steps))
    world, global_batch = split.data_parallel, split.required_global()
    tokens_per_step = global_batch * cfg.data.max_length
    from overdrive.data.sources import holdout_fraction  # torch comes with data/: plan has it by now

    train_tokens = steps = epochs = samples = None
    max_steps = t.max_steps
    held_out = holdout_fraction(cfg)
    if data.tokens is not None:
        train_tokens = int(data.tokens * (1 - held_out))
        samples = train_tokens // cfg.data.max_length  # packed blocks of max_length tokens
    if data.samples is not None:  # counted as the run counts them (pairs, rows, completion slots)
        samples = data.samples
    if samples is not None:
        steps = samples // global_batch
        if t.num_epochs is not None and steps:
            from overdrive.config.length import steps_for

            max_steps = steps_for(t.num_epochs, steps)  # as the run will count them (config/length.py)
        epochs = max_steps / steps if steps else None
    return Arithmetic(world, micro_batch, t.gradient_accumulation_steps, cfg.data.max_length, global_batch,
                      tokens_per_step, max_steps, train_tokens, steps, epochs, held_out, samples)
