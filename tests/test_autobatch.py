"""`training.micro_batch_size: auto`: the largest micro-batch that fits, the global batch kept,
under every strategy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from overdrive.training.build import autobatch
from overdrive.config.schema import RunConfig
from overdrive.errors import UserError
from overdrive.memory.report import Capacity

TINY = {
    "model": {"architecture": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64}},
    "tokenizer": {"vocab_size": 512},
    "data": {"max_length": 32},
    "training": {"micro_batch_size": "auto", "global_batch_size": 16, "gradient_accumulation_steps": 4},
}
PLENTY = Capacity(8 * 2**30, 8 * 2**30, "host", "8 GiB (test)")


def config(**training) -> RunConfig:
    data = json.loads(json.dumps(TINY))
    data["training"].update(training)
    return RunConfig.model_validate(data)


def test_the_global_batch_is_required_and_must_divide_over_the_processes():
    with pytest.raises(UserError, match="training.global_batch_size"):
        autobatch.per_process_batch(config(global_batch_size=None), 1)
    with pytest.raises(UserError, match="does not divide"):
        autobatch.per_process_batch(config(global_batch_size=15), 2)
    assert autobatch.sizes(12) == [12, 6, 4, 3, 2, 1]


def test_everything_fits_so_one_micro_batch_is_the_whole_batch():
    choice = autobatch.choose(config(), 1, probe=lambda m: None, on_gpu=False, capacity=PLENTY)
    assert (choice.micro_batch, choice.accumulation, choice.predicted) == (16, 1, 16)
    assert choice.tried == [(16, "ok")]


def test_the_estimator_bounds_what_a_cpu_probe_may_try():
    cfg = config()
    sizes = {m: autobatch.predict(cfg, [m], PLENTY) for m in (16, 8, 4)}
    assert sizes == {16: 16, 8: 8, 4: 4}
    # Room for the model states and about 4 samples' activations, not 16: (the estimate is
    # per device; headroom 10%).
    from overdrive.memory import estimate
    from overdrive.memory.model_shape import Source, hf_config_for_run, model_shape
    from overdrive.memory.shape import setup_for_run

    shape = model_shape(Source(hf_config_for_run(cfg), "tiny", run=cfg))
    need = {m: estimate(shape, setup_for_run(cfg, "cpu", micro_batch=m), ("ddp",)).rows[0].total_bytes for m in (4, 8)}
    budget = int((need[4] + need[8]) / 2 / 0.9)
    small = Capacity(budget, budget, "host", "test")
    tried = []
    choice = autobatch.choose(cfg, 1, probe=lambda m: tried.append(m), on_gpu=False, capacity=small)
    assert (choice.micro_batch, choice.accumulation, choice.predicted) == (4, 4, 4)
    assert tried == [4]  # nothing above the prediction is tried on a CPU


def test_an_out_of_memory_probe_steps_down_and_a_gpu_steps_up_while_it_fits():
    limit = 4

    def probe(m):
        return None if m <= limit else "out of memory"

    down = autobatch.choose(config(), 1, probe, on_gpu=False, capacity=PLENTY)
    assert (down.micro_batch, down.accumulation) == (4, 4)
    assert down.tried == [(16, "out of memory"), (8, "out of memory"), (4, "ok")]
    # On a GPU a probe is safe above the prediction too: a conservative estimate is corrected.
    from overdrive.memory import estimate  # noqa: F401  (the estimator is the start point)

    cfg = config(global_batch_size=64)
    limit = 32
    predicted = autobatch.predict(cfg, autobatch.sizes(64), PLENTY)
    up = autobatch.choose(cfg, 1, probe, on_gpu=True,
                          capacity=Capacity(1, 1, "gpu", "tiny GPU: the estimate says nothing fits"))
    assert up.predicted is None and up.micro_batch == 32 and predicted == 64
    with pytest.raises(UserError, match="not even a micro-batch of 1"):
        autobatch.choose(cfg, 1, lambda m: "out of memory", on_gpu=False, capacity=PLENTY)


def test_processes_agree_on_the_smallest_answer():
    choice = autobatch.choose(config(), 2, lambda m: None, on_gpu=False, capacity=PLENTY, agree=lambda m: min(m, 2))
    assert (choice.micro_batch, choice.accumulation) == (2, 4) and "another process" in choice.note


def test_the_real_probe_runs_forward_and_backward():
    probe = autobatch.make_probe(config(), torch.device("cpu"))
    assert probe(4) is None


def test_predicted_then_confirmed_on_an_accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    predicted = autobatch.predicted_config(config(), capacity=PLENTY)
    assert (predicted.training.micro_batch_size, predicted.training.gradient_accumulation_steps) == (16, 1)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=1)
        cfg = autobatch.confirm(predicted, accelerator, probe=lambda m: None if m <= 8 else "out of memory",
                                capacity=PLENTY)
        assert (cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps) == (8, 2)
        assert accelerator.gradient_accumulation_steps == 2
        assert cfg.training.global_batch_size == 16
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


DEEPSPEED = """
import json, sys
from overdrive.resolving import load_config
from overdrive import build_accelerator
from overdrive.training.build import autobatch
from overdrive.memory.report import Capacity
cap = Capacity(8 * 2**30, 8 * 2**30, "host", "test")
cfg = autobatch.predicted_config(load_config(cli=sys.argv[1:]), capacity=cap)
acc = build_accelerator(cfg)
cfg = autobatch.confirm(cfg, acc, probe=lambda m: None if m <= 4 else "out of memory", capacity=cap)
ds = acc.state.deepspeed_plugin.deepspeed_config
print(json.dumps([cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps,
                  acc.gradient_accumulation_steps, ds["gradient_accumulation_steps"],
                  ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]]))
"""


DS_ITEMS = [f"model.architecture.{k}={v}" for k, v in TINY["model"]["architecture"].items()] + [
    "tokenizer.vocab_size=512", "data.max_length=32", "training.global_batch_size=16",
    "training.gradient_accumulation_steps=1", "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2",
    "launch.use_cpu=true"]


@pytest.mark.slow
def test_under_deepspeed_the_plugin_is_built_from_integers_and_gets_the_final_split():
    # Resolved with an integer micro-batch (see the next test); predicted_config then does what
    # it does for `auto`: the global batch alone decides.
    done = subprocess.run([sys.executable, "-c", DEEPSPEED, *DS_ITEMS, "training.micro_batch_size=16"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [4, 4, 4, 4, 4, 16]


def test_deepspeed_accepts_micro_batch_auto():
    from overdrive.resolving import load_config

    load_config(cli=[*DS_ITEMS, "training.micro_batch_size=auto"])


# ------------------------------------------------------------------ through the trainer

def _train(tmp_path, name: str, **training) -> list[dict]:
    from accelerate.state import AcceleratorState

    from overdrive.training import loop as trainer
    data = json.loads(json.dumps(TINY))
    data["model"]["architecture"].update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    data["training"].update(max_steps=3, log_every_steps=1, eval_every_steps=None, **training)
    data.update(data={"max_length": 32, "max_bytes": 60_000, "cache_dir": str(tmp_path / "cache")},
                output_dir=str(tmp_path / name), checkpoint={"save_final_model": False},
                logging={"trackers": ["none"], "level": "quiet", "progress": False},
                launch={"threads_per_process": 1})
    threads = torch.get_num_threads()
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        trainer.train(RunConfig.model_validate(data))
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


@pytest.mark.slow
def test_train_with_auto_keeps_the_global_batch_and_the_losses(tmp_path, monkeypatch):
    fixed = _train(tmp_path, "fixed", micro_batch_size=16, gradient_accumulation_steps=1, global_batch_size=None)
    auto = _train(tmp_path, "auto")  # everything fits: one micro-batch of 16
    assert [(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in auto] == [(16, 1)] * 3
    # A device that holds only 4 samples at once: 4 micro-batches of 4, the same training.
    monkeypatch.setattr(autobatch, "make_probe", lambda cfg, device: (lambda m: None if m <= 4 else "out of memory"))
    small = _train(tmp_path, "small")
    assert [(r["micro_batch_size"], r["gradient_accumulation_steps"]) for r in small] == [(4, 4)] * 3
    reference = [r["loss"] for r in fixed]
    assert [r["loss"] for r in auto] == pytest.approx(reference, rel=1e-5)
    assert [r["loss"] for r in small] == pytest.approx(reference, rel=1e-5)
