"""The token cache at size: bounded memory, and a tokenization killed half-way that continues."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest

from overdrive.training.build import tokenizer as tokenizer_mod

PROBE = Path(__file__).resolve().parent / "data_probe.py"


def corpus(path: Path, megabytes: float) -> Path:
    """Standard-library source repeated, each copy with its own first line, up to `megabytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_bytes() for p in sorted(root.glob("*.py"))]
    target, written, copy = int(megabytes * 1e6), 0, 0
    with open(path, "wb") as f:
        while written < target:
            for text in sources:
                chunk = f"# copy {copy}\n".encode() + text
                f.write(chunk)
                written += len(chunk)
                if written >= target:
                    break
            copy += 1
    return path


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bpe")
    text = corpus(root / "sample.txt", 2).read_text(errors="replace")
    tok = tokenizer_mod.train_bpe([text[i:i + 65536] for i in range(0, len(text), 65536)], vocab_size=1024)
    tok.save_pretrained(root / "tok")
    return root / "tok"


def probe(source: Path, bpe_dir: Path, cache: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, str(PROBE), "--source", str(source), "--tokenizer", str(bpe_dir),
                             "--cache", str(cache), "--out", str(out)], env=env)


def run_probe(source: Path, bpe_dir: Path, cache: Path, out: Path) -> dict:
    assert probe(source, bpe_dir, cache, out).wait(timeout=900) == 0
    return json.loads(out.read_text())


@pytest.mark.slow
def test_memory_does_not_grow_with_the_size_of_the_text(tmp_path, bpe_dir):
    small = run_probe(corpus(tmp_path / "small.txt", 4), bpe_dir, tmp_path / "c1", tmp_path / "small.json")
    big = run_probe(corpus(tmp_path / "big.txt", 24), bpe_dir, tmp_path / "c2", tmp_path / "big.json")
    grow_small = small["rss_peak_mb"] - small["rss_before_mb"]
    grow_big = big["rss_peak_mb"] - big["rss_before_mb"]
    ids_mb = big["meta"]["counts"]["train.ids"] * 2 / 1e6
    # Six times the text, the same working set: a few batches, not the corpus or its ids.
    assert grow_big < grow_small + 60, (grow_small, grow_big)
    assert grow_big < 200 and ids_mb > 5, (grow_big, ids_mb)


@pytest.mark.slow
def test_a_tokenization_killed_half_way_continues_and_gives_the_same_ids(tmp_path, bpe_dir):
    source = corpus(tmp_path / "corpus.txt", 8)
    whole = run_probe(source, bpe_dir, tmp_path / "whole", tmp_path / "whole.json")

    killed = probe(source, bpe_dir, tmp_path / "resumed", tmp_path / "killed.json")
    entry = tmp_path / "resumed" / "tokens" / Path(whole["entry"]).name
    deadline = time.time() + 600
    while time.time() < deadline:
        record = entry / "progress.json"
        if record.exists() and json.loads(record.read_text())["bytes"] > 1_000_000:
            break
        assert killed.poll() is None, "finished before it could be killed: make the corpus larger"
        time.sleep(0.02)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (entry / "done.json").exists()
    done_at_kill = json.loads((entry / "progress.json").read_text())["bytes"]

    resumed = run_probe(source, bpe_dir, tmp_path / "resumed", tmp_path / "resumed.json")
    assert resumed["meta"]["resumed_from_bytes"] >= done_at_kill > 0  # continued, did not start over
    assert resumed["meta"]["counts"] == whole["meta"]["counts"]
    for part in ("train", "validation"):
        a = np.fromfile(Path(whole["entry"]) / f"{part}.ids", dtype=np.uint16)
        b = np.fromfile(entry / f"{part}.ids", dtype=np.uint16)
        np.testing.assert_array_equal(a, b)
