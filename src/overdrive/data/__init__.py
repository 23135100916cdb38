"""Data: sources, tokenization and its cache, samplers and loaders.

    sources.py   `load_splits(cfg)`: raw train/validation rows from stdlib, files, save_to_disk or the hub
    tokens.py    `tokenize_splits(...)`: token ids, cached by content and tokenizer
    loaders.py   samplers and DataLoaders in whole global batches
"""

from overdrive.data.loaders import EpochShuffle, collate_for, eval_loader, train_loader
from overdrive.data.sources import TextSplits, content_hash, iter_column, load_splits, stdlib_files
from overdrive.data.tokens import TokenizedSplits, tokenize_splits

__all__ = ["EpochShuffle", "TextSplits", "TokenizedSplits", "collate_for", "content_hash", "eval_loader",
           "iter_column", "load_splits", "stdlib_files", "tokenize_splits", "train_loader"]
