"""Data: sources, streaming tokenization, the memory-mapped token cache, samplers and loaders.

    chat.py      chat rows rendered by the chat template, with the assistant-only loss mask
    chat_samples.py  conversations one per row or packed (position ids restart), their collator
    sources.py   the corpora as stored (stdlib, files, save_to_disk, hub), unread
    opening.py   `open_splits(cfg)`: the train/validation corpora of a run (chat rows rendered by chat.py)
    pieces.py    plain text in bounded pieces; cheap fingerprints of files
    tokens.py    a corpus through the tokenizer into the cache, batch by batch; hold-out by piece
    cache.py     the token cache: resumable writer, memory-mapped reader
    samples.py   PackedBlocks / LabeledTexts over the memory maps, the padding collator
    prepare.py   `prepare(cfg, make_tokenizer)`: tokenizer and datasets, built once per machine
    estimate.py  how long tokenization will take and the cache's size, from a measured sample
    loaders.py   samplers and DataLoaders in whole global batches
    mixing.py    several sources mixed by weight (`data.sources`): the Mixture, source_tokens
"""

from overdrive.data.cache import NotReady
from overdrive.data.chat import sample_kind
from overdrive.data.loaders import EpochShuffle, collate_for, eval_loader, train_loader
from overdrive.data.prepare import cached_token_count, prepare, tokenize, train_texts
from overdrive.data.opening import open_splits
from overdrive.data.sources import Splits, stdlib_files
from overdrive.data.tokens import TokenizedSplits

__all__ = ["EpochShuffle", "NotReady", "Splits", "TokenizedSplits", "cached_token_count", "collate_for",
           "eval_loader", "open_splits", "prepare", "sample_kind", "stdlib_files", "tokenize", "train_loader", "train_texts"]
