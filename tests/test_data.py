"""Data: sources through `datasets`, the BPE and token caches, packing, loaders."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from overdrive import data

from overdrive.training import tokenizer
from overdrive.config.schema import RunConfig
from overdrive.errors import UserError

ROWS = [{"text": f"row {i}: the quick brown fox jumps over the lazy dog " * (1 + i % 3), "label": "pos" if i % 2 else "neg"}
        for i in range(40)]


def config(tmp_path, **sections) -> RunConfig:
    sections.setdefault("data", {})
    sections["data"] = {"cache_dir": str(tmp_path / "cache"), **sections["data"]}
    return RunConfig.model_validate(sections)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def small_bpe(tmp_path_factory):
    texts = [r["text"] for r in ROWS] + ["def f(x):\n    return x + 1\n"] * 20
    return tokenizer.train_bpe(texts, vocab_size=300)


def test_stdlib_files_are_sorted_skip_tests_and_respect_max_bytes():
    files = data.stdlib_files(max_bytes=300_000)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert not any({"test", "tests", "site-packages"} & set(f.relative_to(root).parts) for f in files)
    sizes = [f.stat().st_size for f in files]
    assert sum(sizes[:-1]) < 300_000 <= sum(sizes)


def test_stdlib_source_needs_no_download(tmp_path):
    splits = data.load_splits(config(tmp_path, data={"max_bytes": 200_000, "validation_fraction": 0.1}))
    assert splits.text_column == "text" and len(splits.train) > 5 and len(splits.validation) >= 1
    assert any("def " in t for t in splits.train["text"])


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "txt"])
def test_local_files_of_each_format(tmp_path, fmt):
    import datasets

    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, ROWS)
    elif fmt == "csv":
        datasets.Dataset.from_list(ROWS).to_csv(str(path), index=False)
    elif fmt == "parquet":
        datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    else:
        path.write_text("\n".join(r["text"] for r in ROWS))
    train, validation = data.sources.load_source(str(path), cache_dir=tmp_path / "ds")
    assert validation is None
    # Plain text is one document per file (a language model wants documents, not lines).
    assert len(train) == (1 if fmt == "txt" else len(ROWS))
    assert "quick brown fox" in train["text"][0]


def test_saved_dataset_directory_with_its_own_validation_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                               "validation": datasets.Dataset.from_list(ROWS[30:])})
    dd.save_to_disk(str(tmp_path / "saved"))
    cfg = config(tmp_path, data={"source": str(tmp_path / "saved"), "validation_split": "validation"})
    splits = data.load_splits(cfg)
    assert (len(splits.train), len(splits.validation)) == (30, 10)


def test_hub_layout_directory_goes_through_load_dataset(tmp_path):
    # A local copy of a hub data set repository: split names come from the file names, and
    # `load_dataset(path)` is the very call a hub name takes.
    repo = tmp_path / "user__dataset"
    repo.mkdir()
    write_jsonl(repo / "train.jsonl", ROWS[:32])
    write_jsonl(repo / "validation.jsonl", ROWS[32:])
    splits = data.load_splits(config(tmp_path, data={"source": str(repo), "validation_split": "validation"}))
    assert (len(splits.train), len(splits.validation)) == (32, 8)
    with pytest.raises(UserError, match="data.split"):
        data.load_splits(config(tmp_path, data={"source": str(repo), "split": "nope"}))


def test_missing_source_and_column_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="data.source"):
        data.load_splits(config(tmp_path, data={"source": str(tmp_path / "no_such_dataset_here")}))
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(UserError, match="data.text_column"):
        data.load_splits(config(tmp_path, data={"source": str(tmp_path / "rows.jsonl"), "text_column": "body"}))


def test_holdout_is_seeded_and_max_bytes_limits_rows(tmp_path):
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    cfg = config(tmp_path, data={"source": str(tmp_path / "rows.jsonl"), "validation_fraction": 0.25})
    a, b = data.load_splits(cfg), data.load_splits(cfg)
    assert a.validation["text"] == b.validation["text"] and len(a.validation) == 10
    limited = data.load_splits(config(tmp_path, data={"source": str(tmp_path / "rows.jsonl"), "max_bytes": 500,
                                                      "validation_fraction": 0.0}))
    assert limited.validation is None and 3 <= len(limited.train) < len(ROWS)


def test_bpe_is_byte_level_and_cached_by_content(tmp_path):
    texts = ["def add(a, b):\n    return a + b\n"] * 50 + ["naïve café ☕\n"] * 10
    first = tokenizer.cached_bpe(texts, "hash-a", 300, 10**6, tmp_path)
    cached_dirs = list((tmp_path / "tokenizers").iterdir())
    assert len(cached_dirs) == 1
    again = tokenizer.cached_bpe(iter(()), "hash-a", 300, 10**6, tmp_path)  # no text needed: from the cache
    assert again.get_vocab() == first.get_vocab()
    ids = first("naïve café ☕ <unseen> \x00")["input_ids"]
    assert first.decode(ids) == "naïve café ☕ <unseen> \x00"  # any byte sequence round-trips
    assert first.eos_token == first.pad_token == tokenizer.EOS
    tokenizer.cached_bpe(texts, "hash-b", 300, 10**6, tmp_path)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 2


def test_causal_lm_packs_documents_with_eos_and_caches_tokens(tmp_path, small_bpe, monkeypatch):
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    splits = data.load_splits(config(tmp_path, data={"source": str(tmp_path / "rows.jsonl")}))
    tokens = data.tokenize_splits(splits, small_bpe, "causal-lm", 16, tmp_path / "cache")
    block = tokens.train[0]
    assert block["input_ids"].shape == (16,) and block["input_ids"].dtype.is_floating_point is False
    assert (block["labels"] == block["input_ids"]).all()
    stream = tokens.train.tokens
    assert (stream == small_bpe.eos_token_id).sum() == len(splits.train)  # one EOS per document
    assert len(tokens.train) == len(stream) // 16
    # Same text and tokenizer: read from the cache, not tokenized again.
    monkeypatch.setattr(data.tokens, "token_stream", lambda *a, **k: pytest.fail("tokenized again"))
    again = data.tokenize_splits(splits, small_bpe, "causal-lm", 16, tmp_path / "cache")
    np.testing.assert_array_equal(again.train.tokens, stream)


def test_classification_maps_string_labels_and_pads(tmp_path, small_bpe):
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    cfg = config(tmp_path, model={"task": "sequence-classification"}, data={"source": str(tmp_path / "rows.jsonl")})
    splits = data.load_splits(cfg)
    tokens = data.tokenize_splits(splits, small_bpe, "sequence-classification", 12, tmp_path / "cache")
    assert tokens.label_names == ["neg", "pos"]
    rows = [tokens.train[i] for i in range(3)]
    assert all(len(r["input_ids"]) <= 12 for r in rows)
    batch = data.tokens.PadCollator(small_bpe.pad_token_id)(rows)
    assert batch["input_ids"].shape[0] == 3 and batch["attention_mask"].sum() == sum(len(r["input_ids"]) for r in rows)
    assert set(batch["labels"].tolist()) <= {0, 1}


def test_train_loader_uses_whole_global_batches(tmp_path):
    dataset = data.tokens.PackedBlocks(np.arange(100 * 8, dtype=np.uint16), 8)  # 100 samples
    loader = data.train_loader(dataset, micro_batch_size=4, accumulation=3, world_size=2, seed=0,
                               num_workers=0, pin_memory=False)
    assert len(loader) == 96 // 4  # 4 x 3 x 2 = 24 per global batch; 4 of them fit
    assert len(loader) % 3 == 0
    first = [b["input_ids"][:, 0].tolist() for b in loader]
    second = [b["input_ids"][:, 0].tolist() for b in data.train_loader(dataset, 4, 3, 2, seed=0)]
    assert first == second  # seeded order
    with pytest.raises(UserError, match="training.micro_batch_size"):
        data.train_loader(dataset, micro_batch_size=64, accumulation=2, world_size=1, seed=0)
