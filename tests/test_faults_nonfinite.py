"""Non-finite losses in a real (one-process) run: a NaN step is kept out of the weights,
too many in a row stop the run with a checkpoint, and `stop` stops at the first one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from overdrive.training.build import model as model_mod
from overdrive.training import loop as trainer
from overdrive.config.schema import RunConfig

pytestmark = pytest.mark.slow  # every test here starts processes or trains

# No dropout: runs are compared with each other, and the first run in a fresh cache draws
# from the RNG to measure the CPU's peak FLOPS.
ARCH = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("nonfinite-cache")


def config(out, cache, **training) -> RunConfig:
    return RunConfig.model_validate({
        "model": {"architecture": ARCH}, "tokenizer": {"vocab_size": 512},
        "data": {"max_bytes": 60000, "max_length": 32, "cache_dir": str(cache), "validation_fraction": 0.0},
        "training": {"micro_batch_size": 8, "max_steps": 8, "log_every_steps": 1, "eval_every_steps": None,
                     **training},
        "checkpoint": {"save_final_model": False},
        "logging": {"trackers": ["none"], "progress": False, "level": "quiet"}, "output_dir": str(out)})


def poison(monkeypatch, bad_calls: set[int]):
    """Make the training forward passes numbered `bad_calls` (1-based) return a NaN loss."""
    build = model_mod.build_model
    calls = {"n": 0}

    def hook(module, args, kwargs, output):
        if module.training:
            calls["n"] += 1
            if calls["n"] in bad_calls:
                output.loss = output.loss * float("nan")
        return output

    def build_poisoned(*args, **kwargs):
        model = build(*args, **kwargs)
        model.register_forward_hook(hook, with_kwargs=True)
        return model

    monkeypatch.setattr(model_mod, "build_model", build_poisoned)


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out, step):
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


def test_a_nan_step_is_skipped_without_touching_the_weights(tmp_path, cache, monkeypatch):
    clean = trainer.train(config(tmp_path / "clean", cache, max_steps=3))
    poison(monkeypatch, {4})  # optimizer step 4
    result = trainer.train(config(tmp_path / "run", cache, max_steps=8))
    logged = {r["step"]: r for r in records(tmp_path / "run")}
    assert [logged[s]["nonfinite_skipped"] for s in range(1, 9)] == [0, 0, 0, 1, 0, 0, 0, 0]
    # metrics.jsonl is JSON: a loss that is not a number is written as null
    assert logged[4]["loss"] is None and all(math.isfinite(logged[s]["loss"]) for s in (5, 6, 7, 8))
    assert not result.stopped_early and math.isfinite(result.final_loss)
    assert clean.final_loss == logged[3]["loss"]

    # Step 4 changed nothing: a run stopped after 3 clean steps and one that skipped its
    # 4th hold the same weights (checked through checkpoints of step 3 and step 4).
    monkeypatch.undo()
    poison(monkeypatch, {4})
    trainer.train(config(tmp_path / "four", cache, max_steps=4))
    before, after = weights(tmp_path / "clean", 3), weights(tmp_path / "four", 4)
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_too_many_in_a_row_stop_the_run_with_a_checkpoint(tmp_path, cache, monkeypatch):
    poison(monkeypatch, {3, 4, 5})
    result = trainer.train(config(tmp_path / "run", cache, max_nonfinite_in_a_row=3))
    assert "3 steps in a row" in result.stopped_early and result.steps == 5
    assert (tmp_path / "run" / "checkpoints" / "step-00000005" / "manifest.json").exists()


def test_stop_mode_stops_at_the_first_bad_step(tmp_path, cache, monkeypatch):
    poison(monkeypatch, {2})
    result = trainer.train(config(tmp_path / "run", cache, nonfinite_loss="stop"))
    assert result.steps == 2 and "nonfinite_loss=stop" in result.stopped_early
