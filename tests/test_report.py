"""`overdrive report` and `overdrive compare` on runs whose metrics.jsonl is written here."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from overdrive.config.schema import RunConfig
from overdrive.errors import UserError
from overdrive.reports.summary import load_run, summarize
from overdrive.reports.write import write_report

OVERDRIVE = [sys.executable, "-m", "overdrive.cli"]


def make_run(run_dir: Path, seed: int = 0, strategy: str = "ddp", steps: int = 300, memory_key: str = "peak_memory_mb",
             with_resolved: bool = True) -> Path:
    """A finished run as the trainer leaves it: a log line every 10 steps, eval every 100."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    lines, elapsed = [], 0.0
    for step in range(10, steps + 1, 10):
        warm = min(step / 20, 1.0)
        lr = 1e-3 * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * max(step - 20, 0) / (steps - 20))))
        tokens_per_s = (5200 if step == 10 else 9100 + rng.gauss(0, 250)) * (1.15 if strategy == "fsdp" else 1.0)
        elapsed += 16 * 256 * 10 / tokens_per_s
        record = {
            "step": step, "loss": 3.4 + 5.6 * math.exp(-step / 60) + rng.gauss(0, 0.08), "lr": lr,
            "tokens_per_s": tokens_per_s, "seq_len": 256, "micro_batch_size": 16, "mixed_precision": "no",
            "mfu": tokens_per_s * 6 * 3.7e6 / 1.9e12, "elapsed_s": elapsed,
        }
        memory_mb = 880 + 40 * min(step / 100, 1) + (120 if strategy == "ddp" else 0)
        record[memory_key] = memory_mb * 2**20 if memory_key.endswith("bytes") else memory_mb
        lines.append(record)
        if step % 100 == 0:
            lines.append({"step": step, "eval_loss": 3.55 + 5.3 * math.exp(-step / 60),
                          "eval_accuracy": 0.1 + step / 1000, "elapsed_s": elapsed + 2.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    if with_resolved:
        config = RunConfig.model_validate({"parallel": {"strategy": strategy}, "launch": {"num_processes": 2},
                                           "training": {"micro_batch_size": 16, "max_steps": steps}, "optim": {"lr": 1e-3},
                                           "output_dir": str(run_dir)}).model_dump(mode="json")
        origins = {"parallel.strategy": "cli", "launch.num_processes": "file run.yaml:3", "optim.lr": "default"}
        (run_dir / "resolved.json").write_text(json.dumps({"config": config, "origins": origins}))
    return run_dir


@pytest.mark.slow
def test_report_writes_plots_and_summary(tmp_path):
    run = make_run(tmp_path / "run1")
    result = subprocess.run(OVERDRIVE + ["report", str(run)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = run / "report"
    for name in ("report", "loss", "lr", "throughput", "mfu", "memory"):
        png = report / f"{name}.png"
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = (report / "summary.md").read_text()
    assert "| micro-batch x accum x data-parallel | 16 x 1 x 2 = 32 sequences (8,192 tokens) per step |" in summary
    assert "| strategy | ddp |" in summary and "| learning rate | 0.001 (cosine) |" in summary
    assert "final eval loss" in summary and "peak memory" in summary and "wall time" in summary
    assert "`parallel.strategy` = `ddp` from cli" in summary and "optim.lr` =" not in summary
    assert "![report](report.png)" in summary
    assert "final loss" in result.stdout  # the table, plain because stdout is a pipe
    assert "\x1b[" not in result.stdout


def test_summary_numbers(tmp_path):
    run = load_run(make_run(tmp_path / "r", memory_key="peak_memory_bytes"))
    s = summarize(run)
    _, losses = zip(*[(r["step"], r["loss"]) for r in run.train])
    assert s["first_loss"] == losses[0] and s["final_loss"] == losses[-1] and s["min_loss"] == min(losses)
    assert s["final_eval_loss"] == pytest.approx(3.55 + 5.3 * math.exp(-5))
    assert s["peak_memory_bytes"] == pytest.approx(1040 * 2**20)
    assert 8500 < s["mean_tokens_per_s"] < 9700  # the slow first window is left out
    assert s["steps"] == 300 and s["global_batch"] == 32 and s["wall_time_s"] > 100


@pytest.mark.parametrize("key,scale", [("peak_mem_bytes", 1), ("peak_memory_mb", 2**20), ("max_memory_allocated", 1)])
def test_memory_field_names(tmp_path, key, scale):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0, key: 5}) + "\n")
    assert summarize(load_run(tmp_path))["peak_memory_bytes"] == 5 * scale


def test_sparse_metrics_without_resolved(tmp_path):
    """A CPU run with no MFU, no memory, a torn last line: still a report."""
    lines = [json.dumps({"step": s, "loss": 5.0 - s / 10}) for s in range(1, 6)] + ['{"step": 6, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    summary_path, images, summary = write_report(tmp_path)
    assert summary["final_loss"] == pytest.approx(4.5) and summary["mean_mfu"] is None
    assert [p.name for p in images] == ["report.png", "loss.png"]
    text = summary_path.read_text()
    assert "could not be read" in text and "No resolved.json" in text and "mean MFU" not in text


@pytest.mark.slow
def test_missing_run_dir_and_metrics_name_the_path(tmp_path):
    with pytest.raises(UserError, match="nowhere"):
        load_run(tmp_path / "nowhere")
    with pytest.raises(UserError, match=r"metrics\.jsonl"):
        load_run(tmp_path)
    result = subprocess.run(OVERDRIVE + ["report", str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert result.returncode == 2 and "nowhere" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_compare(tmp_path):
    a = make_run(tmp_path / "ddp", seed=1, strategy="ddp")
    b = make_run(tmp_path / "fsdp", seed=2, strategy="fsdp")
    plot = tmp_path / "cmp.png"
    result = subprocess.run(OVERDRIVE + ["compare", str(a), str(b), "--plot", str(plot)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "parallel.strategy" in out and "fsdp" in out and "output_dir" in out
    assert "optim.lr" not in out  # equal keys are not differences
    assert "mean tokens/s" in out and "peak memory" in out and "%" in out
    assert plot.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(subprocess.run(OVERDRIVE + ["compare", str(a), str(b), "--json"], capture_output=True,
                                     text=True, timeout=60).stdout)
    assert {"key": "parallel.strategy", "a": "ddp", "b": "fsdp"} in data["config"]


def test_an_rl_run_gets_its_reward_and_completion_length_drawn(tmp_path):
    from overdrive.reports.plots import plot_run

    run_dir = tmp_path / "grpo"
    run_dir.mkdir()
    lines = [{"step": s, "loss": 0.0, "reward": 0.1 * s, "completions/mean_length": 4.0 - 0.1 * s} for s in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    written = {p.stem for p in plot_run(load_run(run_dir), tmp_path)}
    assert {"rl_reward", "rl_completion_length"} <= written and "preference_accuracy" not in written
