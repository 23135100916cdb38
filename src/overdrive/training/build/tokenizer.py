"""Tokenizers: a pretrained one through the Auto class, or a byte-level BPE trained on the data.

A BPE trained on the fly is cached under `<cache_dir>/tokenizers/`, keyed by a hash of the
text it was trained on and of its settings, so a second run with the same data reuses it
instead of spending the seconds again.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Optional

from overdrive.config.schema import RunConfig
from overdrive.data.pieces import limited

EOS = "<|endoftext|>"
# Bump when the way a BPE is built changes, so stale cached tokenizers are not reused.
_BPE_RECIPE = "bytelevel-bpe-v2"  # v2: keyed by the corpus fingerprint, trained on its leading pieces


def bpe_cache_key(content_hash: str, vocab_size: int, max_bytes: int) -> str:
    text = f"{_BPE_RECIPE}|{content_hash}|{vocab_size}|{max_bytes}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]



def train_bpe(texts: Iterable[str], vocab_size: int, max_bytes: int = 20_000_000):
    """Train a byte-level BPE (GPT-2's scheme: any byte sequence round-trips) on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        # Seed the vocabulary with all 256 byte symbols so no input is ever unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(limited(texts, max_bytes), trainer=trainer)
    # One special token serves as end-of-document, padding and bos: GPT-2 does the same.
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def cached_bpe(texts: Iterable[str], content_hash: str, vocab_size: int, max_bytes: int, cache_dir: Path,
               only_cached: bool = False):
    """Load the BPE for this content from the cache, or train and store it.

    With `only_cached`, a missing BPE raises `overdrive.data.NotReady` instead: another
    process is training it.
    """
    from transformers import PreTrainedTokenizerFast

    target = Path(cache_dir) / "tokenizers" / f"bpe-{bpe_cache_key(content_hash, vocab_size, max_bytes)}"
    if (target / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(target)
    if only_cached:
        from overdrive.data import NotReady

        raise NotReady(str(target))
    from overdrive.storage import faults

    tokenizer = train_bpe(texts, vocab_size, max_bytes)
    with faults.writing(target, "data.cache_dir", what="the trained tokenizer"):
        target.parent.mkdir(parents=True, exist_ok=True)
        # Write into a temporary sibling then rename: a reader never sees a half-written tokenizer.
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        try:
            tokenizer.save_pretrained(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    try:
        tmp.rename(target)
    except OSError:  # another process stored the same tokenizer first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def load_pretrained(name_or_path: str, revision: Optional[str] = None, trust_remote_code: bool = False,
                    key: str = "tokenizer.name_or_path"):
    from transformers import AutoTokenizer

    from overdrive import hub

    with hub.reading(key, name_or_path, what="tokenizer", revision=revision):
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token is None:
        # Decoder-only tokenizers (GPT-2, Llama) ship without one; padding is masked anyway.
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def build_tokenizer(cfg: RunConfig, texts: Iterable[str], content_hash: str, only_cached: bool = False):
    """The run's tokenizer: explicit name, else the model's own, else a BPE trained on `texts`.

    `content_hash` identifies the text (the BPE cache key); with `only_cached` a BPE is never
    trained here (see cached_bpe).
    """
    name = cfg.tokenizer.name_or_path or cfg.model.name_or_path
    if name:
        revision = cfg.model.revision if not cfg.tokenizer.name_or_path else None
        key = "tokenizer.name_or_path" if cfg.tokenizer.name_or_path else "model.name_or_path"
        tokenizer = load_pretrained(name, revision=revision, trust_remote_code=cfg.model.trust_remote_code, key=key)
        if cfg.data.format == "preference" and cfg.tokenizer.chat_template:  # turns need it (data/preference.py)
            from overdrive.data.chat import with_template

            tokenizer = with_template(cfg, tokenizer, name)
        if cfg.data.format == "chat":  # its chat template, or tokenizer.chat_template's, or refused
            from overdrive.data.chat import with_template

            tokenizer = with_template(cfg, tokenizer, name)
        return tokenizer
    return cached_bpe(
        texts,
        content_hash=content_hash,
        vocab_size=cfg.tokenizer.vocab_size,
        max_bytes=cfg.tokenizer.train_max_bytes,
        cache_dir=Path(cfg.data.cache_dir).expanduser(),
        only_cached=only_cached,
    )
