"""How long tokenization will take and how much disk its cache needs, measured on a sample.

The leading pieces of the training corpus (a few MB) go through the same batch encoder as
the real run; MB/s, tokens per byte and bytes per row are extrapolated to the corpus' size:
its file sizes for plain text, its row count (parquet metadata, a table's length, or the
lines of a jsonl/csv counted in its first MiB) for rows. The measurement runs on this
machine as loaded as it is now, so it is a forecast, not a promise.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np

from overdrive.data import cache, tokens
from overdrive.data.chat import sample_kind
from overdrive.data.prepare import cache_kind, encoder_for
from overdrive.data.sources import Splits, TextFiles

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

SAMPLE_BYTES = 2_000_000


@dataclass(frozen=True)
class TokenizeEstimate:
    sample_bytes: int
    sample_tokens: int
    sample_seconds: float
    total_bytes: Optional[int]  # text to tokenize (None: unknown, e.g. a stream of unknown length)
    seconds: Optional[float]
    tokens: Optional[int]
    cache_bytes: Optional[int]  # the token cache on disk: ids (and row ends and labels)
    sample_samples: int = 0  # the training samples the sample's rows became (pairs, rows, KTO's rows kept)

    @property
    def mb_per_s(self) -> float:
        return self.sample_bytes / 1e6 / max(self.sample_seconds, 1e-9)

    @property
    def bytes_per_token(self) -> float:
        return self.sample_bytes / max(self.sample_tokens, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "mb_per_s": self.mb_per_s, "bytes_per_token": self.bytes_per_token}


def sample_texts(splits: Splits, sample_bytes: int = SAMPLE_BYTES) -> tuple[list[str], int, int]:
    """(texts, their bytes, rows or raw bytes read) from the start of the training corpus."""
    texts, nbytes, advance = [], 0, 0.0
    for batch in splits.train.batches(batch_bytes=min(sample_bytes, 1 << 20)):
        texts += batch.texts
        nbytes += sum(batch.sizes)
        advance += batch.advance
        if nbytes >= sample_bytes:
            break
    return texts, nbytes, int(advance)


def _length(encoded) -> int:
    """Tokens of one encoded piece: ids, or (ids, loss mask) for chat, or None (a dropped conversation)."""
    if encoded is None:
        return 0
    if isinstance(encoded, tuple) and isinstance(encoded[0], tuple):  # a preference pair: both sides
        return sum(len(side[0]) for side in encoded)
    if isinstance(encoded, list) and all(e is None or isinstance(e, tuple) for e in encoded):  # KTO's rows
        return sum(len(e[0]) for e in encoded if e is not None)
    return len(encoded[0]) if isinstance(encoded, tuple) else len(encoded)


def measure(splits: Splits, tokenizer, task: str, max_length: int, sample: tuple[list[str], int, int],
            encoder=None) -> TokenizeEstimate:
    texts, nbytes, advance = sample
    encoder = encoder or tokens.Encoder(tokenizer, task, max_length)
    start = time.perf_counter()
    n_tokens = n_samples = 0
    for i in range(0, len(texts), 16):  # the batches the real run hands to the tokenizer
        encoded = encoder(texts[i:i + 16])
        n_tokens += sum(_length(ids) for ids in encoded)
        n_samples += sum(_samples_of(ids) for ids in encoded)
    seconds = time.perf_counter() - start
    corpus = splits.train
    if isinstance(corpus, TextFiles):
        total = corpus.total
    else:  # rows: the sample's text per row, times the rows
        total = int(corpus.total * nbytes / advance) if corpus.total and advance else None
    if total is not None and splits.max_bytes is not None:
        total = min(total, splits.max_bytes)
    if total is None:
        return TokenizeEstimate(nbytes, n_tokens, seconds, None, None, None, None, n_samples)
    est_tokens = int(total * n_tokens / max(nbytes, 1))
    per_token = np.dtype(tokens.id_dtype(tokenizer)).itemsize
    if task == "preference":
        index = (corpus.total or 0) * 16 + est_tokens  # two sequence ends per pair, a one-byte mask per token
    elif task in ("chat", "unpaired"):
        index = (corpus.total or 0) * 8 + est_tokens  # conversation ends (int64), a one-byte loss mask per token
    elif task != "causal-lm" and advance:
        rows = corpus.total or 0
        index = rows * (8 + 4)  # row ends (int64) and labels (int32)
    else:
        index = 0
    return TokenizeEstimate(nbytes, n_tokens, seconds, total, seconds * total / max(nbytes, 1), est_tokens,
                            est_tokens * per_token + index, n_samples)


def cached_entry(cfg: RunConfig, splits: Splits, tokenizer) -> Optional[Path]:
    """The complete cache entry of the training corpus, if there is one."""
    d = cfg.data
    names = splits.train.label_names if cfg.model.task != "causal-lm" else None
    key = tokens.entry_key(splits.train.key, cache_kind(cfg, tokenizer), d.max_length, tokenizer, splits.holdout,
                           cfg.training.seed, d.max_bytes, names)
    entry = Path(d.cache_dir).expanduser() / "tokens" / key
    return entry if cache.done(entry) is not None else None


@dataclass(frozen=True)
class Forecast:
    """What tokenizing this run's data will cost, or that it is already cached."""

    cached_tokens: Optional[int] = None  # exact, from a complete cache entry
    entry: Optional[str] = None
    estimate: Optional[TokenizeEstimate] = None
    tokenizer_seconds: Optional[float] = None  # training a BPE on the fly, extrapolated from the sample
    note: str = ""
    # The training samples of one epoch, counted as the run counts them (len of its train set) where
    # a sample is not a packed block of tokens: RL's completion slots, pairs, rows, conversations.
    samples: Optional[int] = None
    samples_basis: str = ""

    def to_dict(self) -> dict:
        return {"cached_tokens": self.cached_tokens, "cache_entry": self.entry, "tokenizer_seconds":
                self.tokenizer_seconds, "note": self.note, "samples": self.samples, "samples_basis": self.samples_basis,
                **(self.estimate.to_dict() if self.estimate else {})}


def forecast(cfg: RunConfig, make_tokenizer, train_sample_bpe) -> Forecast:
    """The cache entry if complete; else a measured forecast. Needs local data (a hub name is not read).

    `make_tokenizer(cfg, texts, key, only_cached=True)` as in prepare(); when it has no cached
    BPE, `train_sample_bpe(texts)` trains one on the sample, timed, to measure with.
    """
    from overdrive.data.opening import open_splits

    d = cfg.data
    if d.format == "prompts":  # RL: read whole at the start, nothing cached (data/prompts.py)
        samples, basis = _prompt_slots(cfg)
        return Forecast(note="prompts are not tokenized ahead: the completions are generated in the loop",
                        samples=samples, samples_basis=basis)
    from overdrive.hf.vision import declared

    if declared(cfg) and Path(d.source).expanduser().is_file():  # rows with images (data/vision_samples.py)
        samples, basis = _vision_rows(cfg)
        return Forecast(note="rows with images are encoded as the run starts (no token cache for images)",
                        samples=samples, samples_basis=basis)
    if d.source != "stdlib" and not Path(d.source).expanduser().exists():
        return Forecast(note=f"{d.source!r} is not local: measured once downloaded (or bound it with data.max_bytes)")
    splits = open_splits(cfg)
    sample = None
    tokenizer_seconds = None
    try:
        tokenizer = make_tokenizer(cfg, iter(()), splits.train_key(), only_cached=True)
    except cache.NotReady:
        sample = sample_texts(splits)
        start = time.perf_counter()
        tokenizer = train_sample_bpe(sample[0])
        bpe_bytes = min(cfg.tokenizer.train_max_bytes, getattr(splits.train, "total", None) or cfg.tokenizer.train_max_bytes)
        tokenizer_seconds = (time.perf_counter() - start) * max(bpe_bytes / max(sample[1], 1), 1.0)
    else:
        entry = cached_entry(cfg, splits, tokenizer)
        if entry is not None:
            meta = cache.done(entry) or {}
            n = sum(v for k, v in meta.get("counts", {}).items() if k.endswith(".ids"))
            samples = _cached_samples(cfg, entry, tokenizer)
            return Forecast(cached_tokens=n, entry=str(entry), samples=samples,
                            samples_basis=f"{_unit(cfg)} in the token cache (exact)" if samples is not None else "")
    sample = sample or sample_texts(splits)
    estimate = measure(splits, tokenizer, sample_kind(cfg), d.max_length, sample, encoder_for(cfg, tokenizer))
    samples, basis = _row_samples(cfg, splits, sample, estimate)
    return Forecast(estimate=estimate, tokenizer_seconds=tokenizer_seconds, samples=samples, samples_basis=basis)


def _per_row(cfg: RunConfig) -> bool:
    """Whether a training sample is a row of the data (a pair, a KTO row, a labelled text, a
    conversation not packed) rather than a packed block of data.max_length tokens."""
    kind = sample_kind(cfg)
    return kind != "causal-lm" and not (kind == "chat" and cfg.data.packing)


def _unit(cfg: RunConfig) -> str:
    return {"preference": "pairs", "unpaired": "KTO rows", "chat": "conversations"}.get(sample_kind(cfg), "rows")


def _cached_samples(cfg: RunConfig, entry: Path, tokenizer) -> Optional[int]:
    """The cached entry's training samples, opened as the run opens them (data/prepare.py)."""
    if not _per_row(cfg):
        return None
    parts = tokens.open_entry(entry, task=sample_kind(cfg), max_length=cfg.data.max_length, packing=cfg.data.packing,
                              pad_id=tokenizer.pad_token_id or 0)
    return len(parts["train"]) if parts["train"] is not None else 0


def _samples_of(encoded) -> int:
    """Training samples one row becomes: none (dropped), one, or KTO's several."""
    if encoded is None:
        return 0
    if isinstance(encoded, list) and all(e is None or isinstance(e, tuple) for e in encoded):
        return sum(e is not None for e in encoded)
    return 1


def _row_samples(cfg: RunConfig, splits: Splits, sample: tuple[list[str], int, int],
                 estimate: TokenizeEstimate) -> tuple[Optional[int], str]:
    """The rows of the train split, less the hold-out, times the samples a row became in the sample
    (rows dropped, KTO's rows): an estimate of the run's samples per epoch."""
    texts, _, rows_read = sample
    rows = getattr(splits.train, "total", None)
    if not _per_row(cfg) or isinstance(splits.train, TextFiles) or not rows or not texts:
        return None, ""
    per_row = estimate.sample_samples / max(rows_read or len(texts), 1)
    samples = int(rows * (1 - splits.holdout) * per_row)
    held = f" less the {splits.holdout:.0%} validation hold-out" if splits.holdout else ""
    return samples, (f"estimate: {rows:,} rows{held} x {per_row:.2f} {_unit(cfg)} per row (measured on "
                     f"{len(texts):,} rows)")


def _vision_rows(cfg: RunConfig) -> tuple[Optional[int], str]:
    """A vision-language run's conversations (or pairs): one sample a row, less the validation hold-out (rows
    longer than data.max_length and dropped are known once encoded)."""
    from overdrive.data import vision_rows

    if cfg.data.packing:  # how many conversations share a row is known once they are encoded
        return None, ""
    rows = len(vision_rows.table(cfg).rows)
    held = cfg.data.validation_fraction
    samples = int(rows * (1 - held))
    unit = "preference pairs" if cfg.preference.method != "none" else "conversations"
    return samples, (f"estimate: {rows:,} {unit} with images" +
                     (f" less the {held:.0%} validation hold-out" if held else "") + " (rows too long to keep "
                     "counted once encoded)")


def _prompt_slots(cfg: RunConfig) -> tuple[Optional[int], str]:
    """RL's epoch: every prompt's group of completions (data/prompts.epoch_slots), as the loop counts it."""
    from overdrive.data import prompts

    if cfg.data.source != "stdlib" and not Path(cfg.data.source).expanduser().exists():
        return None, ""
    count = len(prompts.read(cfg))
    rl = cfg.rl
    slots = prompts.epoch_slots(count, rl.num_generations, rl.num_iterations)
    return slots, (f"{count:,} prompts x rl.num_generations={rl.num_generations} x rl.num_iterations="
                   f"{rl.num_iterations} = {slots:,} completions (exact)")
