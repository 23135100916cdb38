"""Nothing a user has is replaced without --force: a finished run rerun with another config,
a reference file the user wrote, a report directory that already holds files."""

from __future__ import annotations

import json

import pytest
from checkpoint_probe import command, run
from conftest import run_here


@pytest.mark.slow
def test_a_finished_run_rerun_with_another_lr_is_refused_and_its_record_kept(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = ["training.max_steps=2", "checkpoint.every_steps=2"]
    first = run(command(out, cache, *args), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (out / "metrics.jsonl").read_bytes()
    resolved = (out / "resolved.json").read_bytes()
    again = run(command(out, cache, *args, "optim.lr=1e-4"), cwd=tmp_path)
    assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-3000:]
    assert "optim.lr" in again.stderr and "--force" in again.stderr and "new output_dir" in again.stderr
    assert "Traceback" not in again.stderr
    assert (out / "metrics.jsonl").read_bytes() == before and (out / "resolved.json").read_bytes() == resolved
    explain = command(out, cache, *args, "optim.lr=1e-4")
    explained = run([*explain[:3], "explain", *explain[4:], "--json"], cwd=tmp_path)
    assert explained.returncode == 0, explained.stderr[-2000:]
    resume = json.loads(explained.stdout)["resume"]
    assert resume["train"] == "refused" and "optim.lr" in resume["changed"] and "--force" in resume["text"]


def test_docs_keeps_a_file_it_did_not_write_and_check_names_a_missing_file(tmp_path):
    mine = tmp_path / "config.md"
    mine.write_text("my own notes\n")
    refused = run_here("docs", "-o", str(mine))
    assert refused.returncode == 2 and "--force" in refused.stderr and mine.read_text() == "my own notes\n"
    assert run_here("docs", "-o", str(mine), "--force").returncode == 0 and "overdrive docs" in mine.read_text()
    assert run_here("docs", "-o", str(mine)).returncode == 0  # its own reference: regenerated freely
    missing = run_here("docs", "--check", "-o", str(tmp_path / "missing.md"))
    assert missing.returncode == 2 and "missing" in missing.stderr and "stale" not in missing.stderr


def test_report_into_a_directory_that_holds_files_is_refused_without_force(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 100.0, "seq_len": 16,
              "micro_batch_size": 2, "mixed_precision": "no", "mfu": None, "time": 1000.0 + s} for s in range(1, 6)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    target = tmp_path / "mine"
    target.mkdir()
    (target / "summary.md").write_text("kept\n")
    refused = run_here("report", str(run_dir), "-o", str(target))
    assert refused.returncode == 2 and "--force" in refused.stderr, refused.stderr
    assert (target / "summary.md").read_text() == "kept\n"
    assert run_here("report", str(run_dir), "-o", str(target), "--force", "-q").returncode == 0
    assert (target / "summary.md").read_text() != "kept\n"
