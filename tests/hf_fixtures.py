"""A tiny causal LM and a text data set, made on the spot (no hub access): what the Trainer
and TRL examples train in the tests."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = "the a model trains on text data every step one two three four loss goes down slowly".split()


def make_text_data(path: Path, rows: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20)))}) + "\n")
    return path


def make_tiny_model(directory: Path) -> Path:
    """A 2-layer GPT-2 (hidden size 32) and a word-level tokenizer, saved with save_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>", bos_token="<eos>")
    import torch

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(vocab), n_positions=64,
                                       pad_token_id=0, eos_token_id=2, bos_token_id=2))
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
