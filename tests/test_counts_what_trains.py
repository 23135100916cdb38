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
                   f"data.source={tmp_path / 'text.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}",
                   f"output_dir={tmp_path / 'run'}", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads(done.stdout)
    assert trainable < plan["parameters"] // 2
    assert plan["memory"]["optimizer_bytes"] == 8 * trainable  # AdamW's two fp32 moments, adapter only
    assert plan["memory"]["grads_bytes"] == 4 * trainable
