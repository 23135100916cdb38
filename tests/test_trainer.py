"""The training loop: end to end on a tiny model, exact accumulation, bf16, classification,
the schedule, the command and the programmatic example."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from overdrive.training.build import optimization

from overdrive.training import loop as trainer
from overdrive.config.schema import RunConfig

REPO = Path(__file__).resolve().parents[1]
TINY_ARCH = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
ARCH_CLI = [f"model.architecture.{key}={value}" for key, value in TINY_ARCH.items()]
REQUIRED = {"step", "loss", "lr", "tokens_per_s", "seq_len", "micro_batch_size", "mixed_precision", "mfu",
            "peak_memory_mb"}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # Shared by the tests of this file: BPE, tokens and the CPU peak are content-addressed.
    return tmp_path_factory.mktemp("overdrive-cache")


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def tiny(tmp_path, cache_dir, **sections) -> RunConfig:
    base = {
        "model": {"architecture": TINY_ARCH},
        "tokenizer": {"vocab_size": 512},
        "data": {"max_bytes": 150_000, "max_length": 32, "cache_dir": str(cache_dir)},
        "optim": {"lr": 1e-2},
        "scheduler": {"warmup_steps": 3},
        "training": {"micro_batch_size": 8, "max_steps": 30, "log_every_steps": 5, "eval_every_steps": 10,
                     "eval_batches": 4},
        "logging": {"trackers": ["none"], "progress": False, "level": "quiet"},
        "output_dir": str(tmp_path / "run"),
    }
    return RunConfig.model_validate(merge(base, sections))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model" / "model.safetensors"))


# ---------------------------------------------------------------- pure parts

def test_warmup_then_cosine_to_the_floor():
    def f(step):
        return optimization.lr_factor(step, "cosine", warmup_steps=4, max_steps=20, min_lr_ratio=0.1)

    assert [round(f(s), 3) for s in range(5)] == [0.2, 0.4, 0.6, 0.8, 1.0]
    assert f(20) == pytest.approx(0.1) and f(12) == pytest.approx(0.55)
    assert optimization.lr_factor(12, "linear", 4, 20, 0.1) == pytest.approx(0.5)
    assert optimization.lr_factor(19, "constant", 4, 20, 0.1) == 1.0


def test_no_weight_decay_on_biases_and_norms():
    from overdrive.training.build.model import build_model

    model = build_model(RunConfig.model_validate({"model": {"architecture": TINY_ARCH}}), vocab_size=100)
    decay, no_decay = optimization.param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(".bias" in names[id(p)] or "ln_" in names[id(p)] for p in no_decay["params"])
    assert any("wte" in names[id(p)] for p in decay["params"]) and any("c_fc" in names[id(p)] for p in decay["params"])


def test_adamw_kernel_choice():
    assert optimization.adamw_kernel("auto", "cpu") == {"fused": True, "foreach": False}  # torch >= 2.4 fuses on CPU
    assert optimization.adamw_kernel("foreach", "cuda") == {"fused": False, "foreach": True}
    assert optimization.adamw_kernel("for-loop", "cuda") == {"fused": False, "foreach": False}


# ---------------------------------------------------------------- end to end

@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path, cache_dir):
    result = trainer.train(tiny(tmp_path, cache_dir))
    run = tmp_path / "run"
    logged = records(run)
    train_records = [r for r in logged if "loss" in r]
    assert [r["step"] for r in train_records] == [1, 5, 10, 15, 20, 25, 30]
    assert all(REQUIRED <= r.keys() for r in train_records)
    last = train_records[-1]
    assert last["seq_len"] == 32 and last["micro_batch_size"] == 8 and last["mixed_precision"] == "no"
    assert last["tokens_per_s"] > 0 and 0 < last["mfu"] < 1.5 and last["peak_memory_mb"] > 0
    assert [r["step"] for r in logged if "eval_loss" in r] == [10, 20, 30]
    # From about ln(vocab) down.
    assert abs(result.first_loss - math.log(512)) < 0.3
    assert result.final_loss < 0.9 * result.first_loss and result.eval["eval_loss"] < result.first_loss
    assert json.loads((run / "resolved.json").read_text())["config"]["training"]["max_steps"] == 30

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run / "model")
    tok = AutoTokenizer.from_pretrained(run / "model")
    ids = tok("def main():\n", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape[-1] == 512


@pytest.mark.slow
def test_accumulation_is_exact_and_the_schedule_counts_optimizer_steps(tmp_path, cache_dir):
    common = {"training": {"max_steps": 6, "log_every_steps": 1, "eval_every_steps": None, "gradient_clipping": 1.0},
              "data": {"validation_fraction": 0.0}, "scheduler": {"warmup_steps": 2}}
    accumulated = tiny(tmp_path / "a", cache_dir, **merge(common, {"training": {"micro_batch_size": 4,
                                                                                "gradient_accumulation_steps": 2}}))
    whole = tiny(tmp_path / "b", cache_dir, **merge(common, {"training": {"micro_batch_size": 8}}))
    trainer.train(accumulated)
    trainer.train(whole)
    wa, wb = weights(tmp_path / "a" / "run"), weights(tmp_path / "b" / "run")
    assert wa.keys() == wb.keys()
    for name in wa:
        # fp32; the only difference is the order of a sum (mean of two means of 4 vs mean of 8).
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-5, msg=name)
    la, lb = records(tmp_path / "a" / "run"), records(tmp_path / "b" / "run")
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], rel=1e-5)
    # One schedule step per optimizer step, not per micro-batch.
    expected = [1e-2 * optimization.lr_factor(s - 1, "cosine", 2, 6, 0.1) for s in range(1, 7)]
    assert [r["lr"] for r in la] == pytest.approx(expected)
    assert la[-1]["tokens"] == lb[-1]["tokens"] == 6 * 8 * 32


@pytest.mark.slow
def test_bf16_mixed_precision_trains_on_cpu(tmp_path, cache_dir):
    result = trainer.train(tiny(tmp_path, cache_dir, precision={"mixed_precision": "bf16"},
                                training={"max_steps": 20, "eval_every_steps": None}))
    assert {r["mixed_precision"] for r in records(tmp_path / "run") if "loss" in r} == {"bf16"}
    assert result.final_loss < 0.9 * result.first_loss
    assert next(iter(weights(tmp_path / "run").values())).dtype == torch.float32  # master weights stay fp32


GOOD, BAD = ["great", "excellent", "lovely", "superb"], ["awful", "terrible", "dreadful", "poor"]
FILLER = "the a film plot was acting and it with some very this story cast".split()


def sentiment_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.random() < 0.5
        words = rng.choices(FILLER, k=rng.randint(5, 10))
        words.insert(rng.randint(0, len(words)), rng.choice(GOOD if label else BAD))
        rows.append({"text": " ".join(words), "label": "positive" if label else "negative"})
    return rows


@pytest.mark.slow
def test_sequence_classification_learns_well_above_chance(tmp_path, cache_dir):
    # A hub-layout directory (train/validation files): the same `load_dataset` path as a hub name.
    repo = tmp_path / "sentiment"
    repo.mkdir()
    for split, n, seed in (("train", 800, 0), ("validation", 200, 1)):
        (repo / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sentiment_rows(n, seed)))
    cfg = tiny(tmp_path, cache_dir, model={"task": "sequence-classification"}, tokenizer={"vocab_size": 300},
               data={"source": str(repo), "validation_split": "validation", "max_bytes": None},
               training={"micro_batch_size": 16, "max_steps": 80, "eval_every_steps": 40, "eval_batches": 50},
               optim={"lr": 3e-3})
    result = trainer.train(cfg)
    evals = [r for r in records(tmp_path / "run") if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [40, 80]
    assert result.eval["eval_accuracy"] >= 0.85  # chance is 0.5


@pytest.mark.slow
def test_trackers_write_tensorboard_events(tmp_path, cache_dir):
    pytest.importorskip("tensorboard")
    trainer.train(tiny(tmp_path, cache_dir, logging={"trackers": ["auto"]},
                       training={"max_steps": 3, "eval_every_steps": None}))
    assert list((tmp_path / "run").rglob("events.out.tfevents.*"))


# ---------------------------------------------------------------- as a user runs it

@pytest.mark.slow
@pytest.mark.fresh_interpreter  # as the README's command starts it: nothing imported ahead
def test_default_run_from_the_command_line(tmp_path, cache_dir):
    """`overdrive train` as the README's first command, shortened: the embedded default on
    a slice of the standard library, 40 steps (warm-up shortened to match). The full default
    run is the slow test below."""
    proc = run_cli("train", f"data.cache_dir={cache_dir}", "data.max_bytes=2000000", "training.max_steps=40",
                   "scheduler.warmup_steps=10", "training.eval_every_steps=20", "logging.trackers=[none]",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "default"
    assert "run directory: runs/default" in proc.stdout and "overdrive report runs/default" in proc.stdout
    losses = [r["loss"] for r in records(run) if "loss" in r]
    assert abs(losses[0] - math.log(2048)) < 0.3
    assert losses[-1] < 0.85 * losses[0]
    # A worker receives the resolved config as a file and trains exactly that.
    resolved = json.loads((run / "resolved.json").read_text())
    assert resolved["origins"]["training.max_steps"].startswith("cli")


@pytest.mark.slow
def test_resolved_file_is_trained_as_is(tmp_path, cache_dir):
    from overdrive.resolving import resolve

    resolved = resolve(cli=[f"data.cache_dir={cache_dir}", "data.max_bytes=150000", "tokenizer.vocab_size=512",
                            "data.max_length=32", "training.max_steps=2", "training.micro_batch_size=4",
                            *ARCH_CLI, "logging.trackers=[none]",
                            f"output_dir={tmp_path / 'worker'}"], env={})
    (tmp_path / "run.json").write_text(resolved.to_json())
    proc = run_cli("train", "--resolved", str(tmp_path / "run.json"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in records(tmp_path / "worker") if "loss" in r] == [1, 2]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("RUN_SLOW_TESTS"), reason="minutes of training: set RUN_SLOW_TESTS=1")
def test_full_default_run_meets_the_loss_target(tmp_path):
    """The bare `overdrive train` (only the cache redirected): minutes on two cores."""
    proc = run_cli("train", f"data.cache_dir={tmp_path / 'cache'}", cwd=tmp_path, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in records(tmp_path / "runs" / "default") if "loss" in r]
    assert abs(losses[0] - math.log(2048)) < 0.3
    assert losses[-1] < 0.6 * losses[0]


@pytest.mark.slow
def test_programmatic_example_runs(tmp_path, cache_dir):
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_distributed.py"), f"data.cache_dir={cache_dir}",
         "data.max_bytes=150000", "tokenizer.vocab_size=512", "data.max_length=32", "training.max_steps=4",
         "training.micro_batch_size=4", "training.gradient_accumulation_steps=2", *ARCH_CLI,
         f"output_dir={tmp_path / 'example'}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 4" in proc.stdout
    assert (tmp_path / "example" / "model" / "config.json").exists()
