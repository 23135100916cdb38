"""`prepare(cfg, make_tokenizer)`: the run's tokenizer and datasets, built once per machine.

One process per machine (the one told to `build`) trains or loads the tokenizer and fills
the token cache; the others ask for the same caches and, while they are not complete, wait
by polling the files (not in a collective barrier, which would time out on a corpus that
takes an hour). Every process then maps the same token files.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

from overdrive.config.schema import RunConfig
from overdrive.data import cache, chat, pieces, preference, tokens
from overdrive.errors import Problem, UserError
from overdrive.storage import faults
from overdrive.data.progress import TokenizeProgress
from overdrive.data.opening import open_splits
from overdrive.data.sources import Splits, TextFiles

_POLL_S = 0.5


def train_texts(splits: Splits) -> Iterator[str]:
    """The training pieces' text in order (held-out pieces skipped, data.max_bytes respected)."""
    index, seen = 0, 0
    for batch in splits.train.batches():
        for text, size in zip(batch.texts, batch.sizes):
            if splits.max_bytes is not None and seen >= splits.max_bytes:
                return
            seen += size
            if not tokens.held_out(splits.seed, index, splits.holdout):
                yield text
            index += 1


def _until_ready(make: Callable, waiting: bool):
    while True:
        try:
            return make()
        except cache.NotReady:
            if not waiting:
                raise
            time.sleep(_POLL_S)


def _describe(cfg: RunConfig, corpus) -> str:
    return "tokenizing " + ("the standard library" if cfg.data.source == "stdlib" else cfg.data.source)


def cache_kind(cfg: RunConfig, tokenizer) -> str:
    """The token cache's task key: the model task, or chat with its template and mask settings."""
    if preference.is_preference(cfg):
        return preference.template_key(cfg, tokenizer)
    return chat.template_key(cfg, tokenizer) if chat.is_chat(cfg) else cfg.model.task


def encoder_for(cfg: RunConfig, tokenizer):
    if preference.is_preference(cfg) and cfg.preference.method == "kto":
        from overdrive.data.preference_unpaired import UnpairedEncoder

        return UnpairedEncoder(tokenizer, cfg.data.max_length)
    if preference.is_preference(cfg):
        return preference.PreferenceEncoder(tokenizer, cfg.data.max_length)
    if chat.is_chat(cfg):
        return chat.encoder_for(cfg, tokenizer)
    return tokens.Encoder(tokenizer, cfg.model.task, cfg.data.max_length)


def _one(cfg: RunConfig, corpus, tokenizer, holdout: float, names: Optional[list[str]], build: bool, show: bool):
    """A corpus' entry in the token cache: filled here when building and missing, else waited for."""
    d = cfg.data
    key = tokens.entry_key(corpus.key, cache_kind(cfg, tokenizer), d.max_length, tokenizer, holdout, cfg.training.seed,
                           d.max_bytes, names)
    entry = Path(d.cache_dir).expanduser() / "tokens" / key
    _set_aside_if_damaged(entry, build, show)
    if cache.done(entry) is None:
        if not build:
            raise cache.NotReady(str(entry))
        with faults.writing(entry, "data.cache_dir", what="the token cache",
                            hint="the tokens written so far are kept and the next run continues from them"), \
                cache.writing(entry) as needed:
            if needed:
                total = corpus.total
                if isinstance(corpus, TextFiles) and d.max_bytes is not None:
                    total = min(total, d.max_bytes)
                progress = TokenizeProgress(_describe(cfg, corpus), total, corpus.unit,
                                            enabled=show and cfg.logging.progress)
                try:
                    meta = tokens.fill(entry, corpus, encoder_for(cfg, tokenizer),
                                       holdout, cfg.training.seed, d.max_bytes, names, progress)
                finally:
                    progress.close()
                if show:
                    _summary(progress, meta, entry)
    return entry, cache.done(entry)


def _set_aside_if_damaged(entry: Path, build: bool, show: bool) -> None:
    """A complete-looking entry whose files do not match its record (a disk that filled, a copy
    cut short): the building process moves it aside and tokenizes again; the others wait."""
    why = cache.damage(entry)
    if why is None:
        return
    if not build:
        raise cache.NotReady(str(entry))
    aside = cache.set_aside(entry)
    if aside is None:
        raise UserError(Problem("data.cache_dir", f"the token cache {entry} is damaged ({why}) and cannot be moved "
                                "aside", fix=f"delete {entry}, or set data.cache_dir to a directory you can write"))
    if show:
        print(f"token cache: {entry.name} is damaged ({why}); set aside as {aside.name}, tokenizing again",
              file=sys.stderr, flush=True)


def _summary(progress: TokenizeProgress, meta: dict, entry: Path) -> None:
    n = sum(v for k, v in meta["counts"].items() if k.endswith(".ids"))
    resumed = f", continued from {meta['resumed_from_bytes'] / 1e6:,.0f} MB" if meta["resumed_from_bytes"] else ""
    progress.console.print(f"tokenized {meta['text_bytes'] / 1e6:,.1f} MB of text in {meta['seconds']:.0f} s "
                           f"({progress.rate():.2f} MB/s{resumed}): {n:,} tokens, "
                           f"cache {cache.entry_bytes(entry) / 1e6:,.1f} MB in {entry}")
    if "chat" in meta:
        progress.console.print("chat: " + chat.describe_counts(meta["chat"]))
    if "preference" in meta:
        progress.console.print("preference: " + preference.describe_counts(meta["preference"]))
    if "unpaired" in meta:
        from overdrive.data.preference_unpaired import describe_counts

        progress.console.print("kto: " + describe_counts(meta["unpaired"]))


def _document_end(cfg: RunConfig, tokenizer) -> Optional[int]:
    """The id text documents are joined with (tokens.Encoder's), when `data.document_mask` keeps them apart."""
    if not cfg.data.document_mask or chat.sample_kind(cfg) != "causal-lm":
        return None
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if end is None:
        raise UserError(Problem("data.document_mask", "the tokenizer has no EOS (or SEP) token, so the documents "
                                "of a packed block cannot be told apart", fix="set data.document_mask=false"))
    return end


def tokenize(cfg: RunConfig, splits: Splits, tokenizer, build: bool = True, show: bool = False
             ) -> tokens.TokenizedSplits:
    """Token datasets for the splits, from the cache (filled first when `build`)."""
    task, length = cfg.model.task, cfg.data.max_length
    names = splits.train.label_names if task != "causal-lm" else None
    entry, meta = _one(cfg, splits.train, tokenizer, splits.holdout, names, build, show)
    reading = dict(task=chat.sample_kind(cfg), max_length=length, packing=cfg.data.packing,
                   pad_id=tokenizer.pad_token_id or 0, document_end=_document_end(cfg, tokenizer))
    parts = tokens.open_entry(entry, **reading)
    label_names = meta.get("label_names") or []
    validation = parts["validation"]
    if splits.validation is not None:
        # Separate split: its labels must be among the training labels (same class indices).
        fixed = label_names if task != "causal-lm" else None
        entry_v, _ = _one(cfg, splits.validation, tokenizer, 0.0, fixed, build, show)
        validation = tokens.open_entry(entry_v, **reading)["train"]
    if parts["train"] is None:
        raise UserError(Problem("data.source", f"{cfg.data.source!r} gave no training samples"
                                f"{' of ' + str(length) + ' tokens' if task == 'causal-lm' else ''}",
                                fix="give more text, raise data.max_bytes, or lower data.max_length"))
    if "chat" in meta and not meta["chat"].get("loss_tokens", 1):
        raise UserError(Problem("tokenizer.chat_template", f"no token of the {meta['chat']['conversations']:,} "
                                "conversations is in the loss: the template renders no assistant text that can be "
                                "found, so there is nothing to train on",
                                fix="use a template that renders each assistant turn's content, or set "
                                "data.train_on_prompt=true"))
    return tokens.TokenizedSplits(parts["train"], validation, length, label_names)


def prepare(cfg: RunConfig, make_tokenizer: Callable, build: bool = True, show: bool = False):
    """(tokenizer, TokenizedSplits) for the run.

    `make_tokenizer(cfg, texts, content_key, only_cached=...)` gives the tokenizer (training a
    BPE on `texts` when it has to); with `build` False it must raise cache.NotReady rather
    than train, and this process waits for the one that builds.
    """
    if cfg.data.sources:
        return _prepare_mixture(cfg, make_tokenizer, build, show)
    splits = open_splits(cfg)
    tokenizer = _until_ready(lambda: make_tokenizer(cfg, train_texts(splits), splits.train_key(),
                                                    only_cached=not build), waiting=not build)
    datasets = _until_ready(lambda: tokenize(cfg, splits, tokenizer, build, show), waiting=not build)
    return tokenizer, datasets


def cached_token_count(cfg: RunConfig, tokenizer) -> Optional[int]:
    """Token ids in the complete cache entry of the training corpus (train + held out), or None."""
    splits = open_splits(cfg)
    d = cfg.data
    names = splits.train.label_names if cfg.model.task != "causal-lm" else None
    key = tokens.entry_key(splits.train.key, cache_kind(cfg, tokenizer), d.max_length, tokenizer, splits.holdout,
                           cfg.training.seed, d.max_bytes, names)
    meta = cache.done(Path(d.cache_dir).expanduser() / "tokens" / key)
    if meta is None:
        return None
    return sum(v for k, v in meta["counts"].items() if k.endswith(".ids"))


def _mixed_texts(opened: list, weights: list[float], budget: int) -> Iterator[str]:
    """Text for a tokenizer trained on the fly: each source's training text up to its weight's
    share of `budget` bytes, the sources taken in turn, so the vocabulary sees every one."""
    total = sum(weights)
    streams = [pieces.limited(train_texts(splits), int(budget * w / total)) for splits, w in zip(opened, weights)]
    while streams:
        for stream in list(streams):
            text = next(stream, None)
            if text is None:
                streams.remove(stream)
            else:
                yield text


def _prepare_mixture(cfg: RunConfig, make_tokenizer: Callable, build: bool, show: bool):
    """A tokenizer over all the sources, each source tokenized into its own cache entry, and the
    Mixture over their training samples (validation: every source's, concatenated)."""
    import hashlib

    import torch

    from overdrive.data.mixing import Mixture, for_source, source_configs
    from overdrive.errors import Problem, UserError

    parts = source_configs(cfg)
    opened = []
    for part in parts:
        try:
            opened.append(open_splits(part.cfg))
        except UserError as error:
            raise for_source(error, part) from None
    weights = [part.weight for part in parts]
    key = hashlib.sha256("|".join(f"{s.train_key()}:{w}" for s, w in zip(opened, weights)).encode()).hexdigest()
    tokenizer = _until_ready(lambda: make_tokenizer(cfg, _mixed_texts(opened, weights, cfg.tokenizer.train_max_bytes),
                                                    key, only_cached=not build), waiting=not build)
    tokenized = []
    for part, splits in zip(parts, opened):
        try:
            tokenized.append(_until_ready(lambda: tokenize(part.cfg, splits, tokenizer, build, show), waiting=not build))
        except UserError as error:
            raise for_source(error, part) from None
    labels = [t.label_names for t in tokenized]
    if cfg.model.task != "causal-lm" and any(names != labels[0] for names in labels):
        raise UserError(Problem("data.sources", f"the sources' labels differ: {dict(zip([p.name for p in parts], labels))}",
                                fix="mix sources labelled with the same classes"))
    mixture = Mixture([t.train for t in tokenized], [p.name for p in parts], weights, cfg.training.seed,
                      cfg.data.shuffle, cfg.data.when_exhausted)
    validations = [t.validation for t in tokenized if t.validation is not None and len(t.validation)]
    validation = torch.utils.data.ConcatDataset(validations) if validations else None
    return tokenizer, tokens.TokenizedSplits(mixture, validation, cfg.data.max_length, labels[0])
