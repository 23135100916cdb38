"""Tuning never changes the math: the tuned config trains to the same loss trajectory as the
config as given, at the same global batch.

Tolerances, per step, relative: 1e-5 with the same precision (fp32): micro x accumulation
splits, threads and loader workers change only the order of float sums (measured: <= 2e-7).
1e-2 for a bf16 candidate, whose autocast rounds matrix multiplies to 8 bits of mantissa
(measured: 2e-5 over these steps; it grows with model size and run length).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from overdrive.training import loop as trainer
from overdrive.resolving import resolve
from overdrive.tune import TrialPlan, TuneOptions, make_job, run
from overdrive.tune.space import apply

pytestmark = pytest.mark.slow  # every test here starts processes or trains

STEPS = 12
TINY = {
    "model": {"architecture": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64,
                               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}},
    "tokenizer": {"vocab_size": 512},
    "data": {"max_bytes": 60_000, "max_length": 32},
    "optim": {"lr": 3e-3},
    "training": {"micro_batch_size": 8, "max_steps": STEPS, "eval_every_steps": None},
    "scheduler": {"warmup_steps": 2},
    "launch": {"threads_per_process": 1},
}


def losses(cfg, out) -> list[float]:
    cfg = apply(cfg, {"output_dir": str(out), "training.log_every_steps": 1, "checkpoint.save_final_model": False,
                      "logging.trackers": ["none"], "logging.level": "quiet", "logging.progress": False})
    from accelerate.state import AcceleratorState

    threads = torch.get_num_threads()
    AcceleratorState._reset_state(reset_partial_state=True)  # each run as in a fresh process
    try:
        trainer.train(cfg)
    finally:
        torch.set_num_threads(threads)  # train() sets the process's threads from the config
        AcceleratorState._reset_state(reset_partial_state=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_the_tuned_config_trains_exactly_like_the_config_as_given(tmp_path):
    data = json.loads(json.dumps(TINY))
    data["data"]["cache_dir"] = str(tmp_path / "cache")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    given = resolve([tmp_path / "run.yaml"])
    only = {"batch": ["4", "2"], "precision": ["no"], "compile": ["eager"], "workers": ["0", "1"], "threads": ["1"]}
    job = make_job(given, TuneOptions(only=only, plan=TrialPlan.measuring(0.2, startup_timeout_s=60)))
    result = run(job)
    chosen = next(c for c in result["candidates"] if c["label"] == result["chosen"])
    tuned = apply(given.config, chosen["overrides"])
    t = tuned.training
    assert t.micro_batch_size * t.gradient_accumulation_steps == 8  # the global batch, kept

    reference = losses(given.config, tmp_path / "given")
    assert len(reference) == STEPS and reference[-1] < reference[0]
    # The tuned pick, and the candidate farthest from the given one (4 micro-batches of 2,
    # a loader worker): same losses at every step.
    farthest = apply(given.config, {"training.micro_batch_size": 2, "training.gradient_accumulation_steps": 4,
                                    "data.num_workers": 1})
    for name, cfg in (("tuned", tuned), ("farthest", farthest)):
        assert losses(cfg, tmp_path / name) == pytest.approx(reference, rel=1e-5), name
    bf16 = losses(apply(given.config, {"precision.mixed_precision": "bf16"}), tmp_path / "bf16")
    assert bf16 == pytest.approx(reference, rel=1e-2)
