"""Everything that sizes a run counts what trains: a LoRA run's gradients and optimizer state
are those of PEFT's trainable parameters, not of the whole model."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli
from hf_fixtures import make_text_data, make_tiny_llama


@pytest.mark.slow  # a fresh interpreter that builds the model on the meta device and PEFT on it
def test_plan_of_a_lora_run_counts_the_adapters_optimizer_state(tmp_path):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    make_tiny_llama(tmp_path / "base")
    make_text_data(tmp_path / "text.jsonl", rows=32)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                                LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    done = run_cli("plan", f"model.name_or_path={tmp_path / 'base'}", "peft.method=lora", "peft.r=8",
                   "peft.target_modules=all-linear", "launch.use_cpu=true", "precision.mixed_precision=no",
                   f"data.source={tmp_path / 'text.jsonl'}", "data.max_length=128", f"data.cache_dir={tmp_path / 'cache'}",
                   f"output_dir={tmp_path / 'run'}", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout)
    assert trainable < plan["parameters"] // 2
    assert plan["memory"]["optimizer_bytes"] == 8 * trainable  # AdamW's two fp32 moments, adapter only
    assert plan["memory"]["grads_bytes"] == 4 * trainable


def test_profile_throughput_counts_each_data_parallel_replicas_tokens_once(tmp_path, monkeypatch):
    """Two processes in one tensor-parallel group share one batch: tokens/s is one replica's."""
    from overdrive.resolving import resolve
    from overdrive.observe import profile_report

    cfg = resolve(cli=["launch.num_processes=2", "parallel.strategy=ddp", "parallel.tp_size=2",
                       "training.micro_batch_size=4", "training.gradient_accumulation_steps=2",
                       "data.max_length=128"]).config
    monkeypatch.setattr(profile_report, "device_facts", lambda *a: (None, False, False))
    monkeypatch.setattr(profile_report, "judge", lambda *a: ("compute", []))
    ranks = [{"rank": r, "host": "h", "step_s": 2.0, "peak_memory_bytes": 0,
              "phases": {p: 0.0 for p in profile_report.PHASES}} for r in range(2)]
    report = profile_report.summarise(cfg, ranks, tmp_path)
    assert report["tokens_per_s"] == 4 * 2 * 1 * 128 / 2.0


def test_report_counts_a_tensor_parallel_groups_batch_once(tmp_path):
    import json as _json

    from overdrive.reports.summary import load_run, summarize

    cfg = {"launch": {"num_processes": 4}, "parallel": {"tp_size": 2, "cp_size": 1, "sp_size": 1},
           "training": {"micro_batch_size": 2, "gradient_accumulation_steps": 3}, "data": {"max_length": 64}}
    (tmp_path / "resolved.json").write_text(_json.dumps({"config": cfg}))
    (tmp_path / "metrics.jsonl").write_text(_json.dumps({"step": 1, "loss": 2.0, "num_processes": 4}) + "\n")
    summary = summarize(load_run(tmp_path))
    assert summary["data_parallel"] == 2 and summary["global_batch"] == 2 * 3 * 2


def test_the_auto_micro_batch_probe_trains_the_lora_adapter_not_every_weight(tmp_path, monkeypatch):
    import torch

    from hf_fixtures import make_tiny_llama
    from overdrive.resolving import resolve
    from overdrive.training.build import adapter, autobatch

    base = make_tiny_llama(tmp_path / "base")
    cfg = resolve([], cli=[f"model.name_or_path={base}", "peft.method=lora", "peft.r=4", "data.max_length=16",
                           "launch.use_cpu=true"]).config
    probed = []
    real_apply = adapter.apply
    monkeypatch.setattr(adapter, "apply", lambda *a, **k: probed.append(real_apply(*a, **k)) or probed[-1])
    assert autobatch.make_probe(cfg, torch.device("cpu"))(2) is None
    assert len(probed) == 1
    trainable, total = adapter.trainable_counts(probed[0])
    assert 0 < trainable < total // 2
    assert all(p.grad is None for n, p in probed[0].named_parameters() if not p.requires_grad)
