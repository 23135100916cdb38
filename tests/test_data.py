"""Data: sources through `datasets`, the BPE and token caches, packing, loaders."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from overdrive import data

from overdrive.training.build import tokenizer
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


def texts_of(corpus) -> list[str]:
    return [t for batch in corpus.batches() for t in batch.texts]


def test_stdlib_source_needs_no_download(tmp_path):
    splits = data.open_splits(config(tmp_path, data={"max_bytes": 200_000, "validation_fraction": 0.1}))
    assert splits.holdout == 0.1 and splits.validation is None
    texts = list(data.train_texts(splits))
    assert len(texts) > 5 and any("def " in t for t in texts)
    assert sum(len(t.encode()) for t in texts) < 200_000 + 70_000  # held-out pieces left out, the limit kept


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
    splits = data.open_splits(config(tmp_path, data={"source": str(path)}))
    batches = list(splits.train.batches())
    texts = [t for b in batches for t in b.texts]
    ends = [e for b in batches for e in b.ends]
    # Plain text is one document per file, read in pieces; rows are documents.
    assert len(texts) == (1 if fmt == "txt" else len(ROWS)) and all(ends)
    assert "quick brown fox" in texts[0]
    if fmt == "parquet":
        assert splits.train.total == len(ROWS)  # from the file's metadata, for the progress bar


def test_saved_dataset_directory_with_its_own_validation_split(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                               "validation": datasets.Dataset.from_list(ROWS[30:])})
    dd.save_to_disk(str(tmp_path / "saved"))
    cfg = config(tmp_path, data={"source": str(tmp_path / "saved"), "validation_split": "validation"})
    splits = data.open_splits(cfg)
    assert (len(texts_of(splits.train)), len(texts_of(splits.validation))) == (30, 10)
    assert splits.holdout == 0.0


def test_hub_layout_directory_goes_through_load_dataset(tmp_path):
    # A local copy of a hub data set repository: split names come from the file names, and
    # `load_dataset(path)` is the very call a hub name takes.
    repo = tmp_path / "user__dataset"
    repo.mkdir()
    write_jsonl(repo / "train.jsonl", ROWS[:32])
    write_jsonl(repo / "validation.jsonl", ROWS[32:])
    splits = data.open_splits(config(tmp_path, data={"source": str(repo), "validation_split": "validation"}))
    assert (len(texts_of(splits.train)), len(texts_of(splits.validation))) == (32, 8)
    streamed = data.open_splits(config(tmp_path, data={"source": str(repo), "streaming": True}))
    assert texts_of(streamed.train) == texts_of(splits.train)
    with pytest.raises(UserError, match="data.split"):
        data.open_splits(config(tmp_path, data={"source": str(repo), "split": "nope"}))


def test_missing_source_and_column_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="data.source"):
        data.open_splits(config(tmp_path, data={"source": str(tmp_path / "no_such_dataset_here")}))
    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    with pytest.raises(UserError, match="data.text_column"):
        data.open_splits(config(tmp_path, data={"source": str(tmp_path / "rows.jsonl"), "text_column": "body"}))
    with pytest.raises(UserError, match="data.label_column"):
        data.open_splits(config(tmp_path, model={"task": "sequence-classification"},
                                data={"source": str(tmp_path / "rows.jsonl"), "label_column": "y"}))


def test_holdout_depends_on_the_seed_and_the_index_alone():
    chosen = [i for i in range(20_000) if data.tokens.held_out(7, i, 0.1)]
    assert chosen == [i for i in range(20_000) if data.tokens.held_out(7, i, 0.1)]
    assert 1700 < len(chosen) < 2300  # about the fraction
    assert chosen != [i for i in range(20_000) if data.tokens.held_out(8, i, 0.1)]
    assert not any(data.tokens.held_out(7, i, 0.0) for i in range(1000))


def test_holdout_is_seeded_and_max_bytes_limits_rows(tmp_path, small_bpe):
    write_jsonl(tmp_path / "rows.jsonl", ROWS * 10)
    source = {"source": str(tmp_path / "rows.jsonl"), "validation_fraction": 0.25}
    a = data.tokenize(config(tmp_path, data=source), data.open_splits(config(tmp_path, data=source)), small_bpe)
    b = data.tokenize(config(tmp_path / "b", data=source), data.open_splits(config(tmp_path, data=source)), small_bpe)
    np.testing.assert_array_equal(a.validation.tokens, b.validation.tokens)
    assert 0.1 < len(a.validation.tokens) / (len(a.train.tokens) + len(a.validation.tokens)) < 0.4
    other = {**source, "max_length": 16}
    c = data.tokenize(config(tmp_path / "c", data=other, training={"seed": 1}),
                      data.open_splits(config(tmp_path, data=other, training={"seed": 1})), small_bpe)
    assert not np.array_equal(c.validation.tokens, a.validation.tokens)
    limited = {"source": str(tmp_path / "rows.jsonl"), "max_bytes": 500, "validation_fraction": 0.0, "max_length": 8}
    cfg = config(tmp_path, data=limited)
    splits = data.open_splits(cfg)
    texts = list(data.train_texts(splits))
    assert 3 <= len(texts) < len(ROWS) and sum(len(t) for t in texts[:-1]) < 500 <= sum(len(t) for t in texts)
    tokens = data.tokenize(cfg, splits, small_bpe)
    assert tokens.validation is None
    assert (np.asarray(tokens.train.tokens) == small_bpe.eos_token_id).sum() == len(texts)


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
    cfg = config(tmp_path, data={"source": str(tmp_path / "rows.jsonl"), "max_length": 16, "validation_fraction": 0})
    tokens = data.tokenize(cfg, data.open_splits(cfg), small_bpe)
    block = tokens.train[0]
    assert block["input_ids"].shape == (16,) and block["input_ids"].dtype.is_floating_point is False
    assert (block["labels"] == block["input_ids"]).all()
    stream = tokens.train.tokens
    assert isinstance(stream, np.memmap) and stream.dtype == np.uint16  # mapped, not loaded
    assert (stream == small_bpe.eos_token_id).sum() == len(ROWS)  # one EOS per document
    assert len(tokens.train) == len(stream) // 16
    expected = [i for r in ROWS for i in small_bpe(r["text"], add_special_tokens=False)["input_ids"] + [small_bpe.eos_token_id]]
    np.testing.assert_array_equal(stream, expected)
    # Same text and tokenizer: read from the cache, not tokenized again (at any max_length).
    monkeypatch.setattr(data.tokens, "fill", lambda *a, **k: pytest.fail("tokenized again"))
    again = data.tokenize(cfg, data.open_splits(cfg), small_bpe)
    np.testing.assert_array_equal(again.train.tokens, stream)
    longer = config(tmp_path, data={"source": str(tmp_path / "rows.jsonl"), "max_length": 32, "validation_fraction": 0})
    assert len(data.tokenize(longer, data.open_splits(longer), small_bpe).train) == len(stream) // 32


def test_memory_mapped_blocks_pickle_as_their_file(tmp_path, small_bpe):
    import pickle

    write_jsonl(tmp_path / "rows.jsonl", ROWS * 50)
    cfg = config(tmp_path, data={"source": str(tmp_path / "rows.jsonl"), "max_length": 16})
    blocks = data.tokenize(cfg, data.open_splits(cfg), small_bpe).train
    payload = pickle.dumps(blocks)
    assert len(payload) < 1000 < blocks.tokens.nbytes  # a DataLoader worker maps the file, no copy
    copy = pickle.loads(payload)
    assert isinstance(copy.tokens, np.memmap) and (copy[5]["input_ids"] == blocks[5]["input_ids"]).all()
    with pytest.raises(IndexError):
        blocks[len(blocks)]


def test_text_pieces_give_the_ids_of_the_whole_text_and_resume_at_the_same_cuts(tmp_path, small_bpe):
    text = "".join(f"def f{i}(x):\n    return x + {i}  # naïve ☕\n\n" + "word " * (i % 50) + "\n" for i in range(300))
    text += "no newline here at all " * 400  # one long line: cut before spaces
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    whole = small_bpe(text, add_special_tokens=False)["input_ids"]
    pieces = list(data.pieces.iter_file_pieces([path], piece_bytes=700))
    assert len(pieces) > 20 and "".join(p[0] for p in pieces) == text
    assert [i for p in pieces for i in small_bpe(p[0], add_special_tokens=False)["input_ids"]] == whole
    assert [p[2] for p in pieces] == [False] * (len(pieces) - 1) + [True]  # one document: EOS at the end only
    resumed = list(data.pieces.iter_file_pieces([path], pieces[9][1], piece_bytes=700))
    assert [p[0] for p in resumed] == [p[0] for p in pieces[10:]]


def test_classification_from_jsonl_and_csv_maps_labels_truncates_and_pads(tmp_path, small_bpe):
    import datasets

    write_jsonl(tmp_path / "rows.jsonl", ROWS)
    datasets.Dataset.from_list(ROWS).to_csv(str(tmp_path / "rows.csv"), index=False)
    for name in ("rows.jsonl", "rows.csv"):
        cfg = config(tmp_path / f"c-{name}", model={"task": "sequence-classification"},
                     data={"source": str(tmp_path / name), "max_length": 12, "validation_fraction": 0.2})
        tokens = data.tokenize(cfg, data.open_splits(cfg), small_bpe)
        assert tokens.label_names == ["neg", "pos"]
        assert isinstance(tokens.train.labels, np.memmap) and isinstance(tokens.train.ends, np.memmap)
        assert len(tokens.train) + len(tokens.validation) == len(ROWS)
        rows = [tokens.train[i] for i in range(len(tokens.train))] + [tokens.validation[i] for i in range(len(tokens.validation))]
        assert all(len(r["input_ids"]) <= 12 for r in rows) and max(len(r["input_ids"]) for r in rows) == 12
        assert sorted(int(r["labels"]) for r in rows) == sorted(int(r["label"] == "pos") for r in ROWS)
        batch = data.samples.PadCollator(small_bpe.pad_token_id)(rows[:3])
        assert batch["input_ids"].shape[0] == 3 and batch["attention_mask"].sum() == sum(len(r["input_ids"]) for r in rows[:3])
    # Integer labels: classes 0..max; a separate validation split with an unseen label is refused.
    write_jsonl(tmp_path / "ints.jsonl", [{"text": r["text"], "label": i % 3} for i, r in enumerate(ROWS)])
    cfg = config(tmp_path / "ints", model={"task": "sequence-classification"},
                 data={"source": str(tmp_path / "ints.jsonl"), "validation_fraction": 0})
    assert data.tokenize(cfg, data.open_splits(cfg), small_bpe).label_names == ["0", "1", "2"]
    repo = tmp_path / "repo"
    repo.mkdir()
    write_jsonl(repo / "train.jsonl", ROWS)
    write_jsonl(repo / "validation.jsonl", [{"text": "x", "label": "unseen"}])
    cfg = config(tmp_path / "repo-cache", model={"task": "sequence-classification"},
                 data={"source": str(repo), "validation_split": "validation"})
    with pytest.raises(UserError, match="data.label_column"):
        data.tokenize(cfg, data.open_splits(cfg), small_bpe)


def test_train_loader_uses_whole_global_batches(tmp_path):
    dataset = data.samples.PackedBlocks(np.arange(100 * 8, dtype=np.uint16), 8)  # 100 samples
    loader = data.train_loader(dataset, micro_batch_size=4, accumulation=3, world_size=2, seed=0,
                               num_workers=0, pin_memory=False)
    assert len(loader) == 96 // 4  # 4 x 3 x 2 = 24 per global batch; 4 of them fit
    assert len(loader) % 3 == 0
    first = [b["input_ids"][:, 0].tolist() for b in loader]
    second = [b["input_ids"][:, 0].tolist() for b in data.train_loader(dataset, 4, 3, 2, seed=0)]
    assert first == second  # seeded order
    with pytest.raises(UserError, match="training.micro_batch_size"):
        data.train_loader(dataset, micro_batch_size=64, accumulation=2, world_size=1, seed=0)
