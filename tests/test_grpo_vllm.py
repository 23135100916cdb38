"""rl.use_vllm: GRPO's generation through vLLM (training/generation/vllm_sampling.py).

vLLM runs on CUDA GPUs only: here the objective's plumbing is checked with a stand-in for the engine
(the weights pushed before each generation, completions cut after their end-of-sequence token, the
sampler's log-probs becoming TRL's importance-sampling ratio in every micro-batch, kept when the batch
is cut again); the GPU test runs one step of a tiny GRPO job with vLLM colocated, and is skipped
without CUDA and vllm.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_fixtures import OneProcessAccelerator

from overdrive.resolving import resolve
from overdrive.training.generation import vllm_sampling


class _Engine:
    """What VLLMSampler answers, from fixed tokens: 3 tokens then the end of sequence and one more (cut)."""

    def __init__(self, eos: int):
        self.eos, self.synced, self.seeds = eos, 0, []

    def sync(self):
        self.synced += 1

    def sample(self, prompt_ids, seeds, group_seeds, num_generations):
        self.seeds.append((list(seeds), list(group_seeds)))
        ids = [[5 + i, 6, 7, self.eos, 9] for i in range(len(prompt_ids))]
        return ids, [[-1.0, -2.0, float("nan"), -0.5, -3.0] for _ in ids]


def _cfg(llama: Path, source: Path, *items: str):
    return resolve((), cli=[f"model.name_or_path={llama}", f"data.source={source}", "data.format=prompts",
                            "data.max_length=64", "rl.method=grpo", "rl.num_generations=4", "rl.max_completion_length=5",
                            "rl.reward_funcs=[{function: exact_match, column: answer}]", "training.micro_batch_size=4",
                            *items], env={}).config


def test_vllms_completions_and_log_probs_reach_the_loss_as_trls_correction(llama, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from overdrive.data import prompts as prompts_mod
    from overdrive.training.objectives import grpo, grpo_batch, grpo_loss

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in ("yes", "ok")))
    cfg = _cfg(llama, source, "rl.vllm_importance_sampling_mode=token_truncate")
    tokenizer = AutoTokenizer.from_pretrained(llama)
    model = AutoModelForCausalLM.from_pretrained(llama).eval()
    rows = [{"prompt": f"say {w}", "answer": w} for w in ("yes", "ok")]  # data.source's rows, read
    objective = grpo.GRPOObjective(cfg, OneProcessAccelerator(), tokenizer, prompts_mod.encode(cfg, rows, tokenizer))
    engine = _Engine(tokenizer.eos_token_id)
    objective.vllm_factory = lambda m: engine
    slots = {"slot": torch.arange(4), "group": torch.zeros(4, dtype=torch.long),
             "prompt_index": torch.zeros(4, dtype=torch.long)}
    [batch] = objective.prepare(model, [slots])
    assert engine.synced == 1  # the weights pushed before the generation
    assert engine.seeds == [([grpo.sampling.mixed_seed(grpo.group_seed(cfg.training.seed, 0), j) for j in range(4)],
                             [grpo.group_seed(cfg.training.seed, 0)])]  # the own sampler's seeds
    assert batch["completion_ids"][0].tolist() == [5, 6, 7, tokenizer.eos_token_id]  # cut after its end
    with torch.no_grad():
        trainer = grpo.completion_logps(model, batch, cfg.rl.temperature)[0]
    sampled = torch.tensor([[-1.0, -2.0, float("nan"), -0.5]] * 4)
    expected = grpo_loss.vllm_importance_ratio(trainer, sampled, batch["completion_mask"], "token_truncate", None, 3.0)
    torch.testing.assert_close(batch["importance_sampling_ratio"], expected)
    assert (batch["importance_sampling_ratio"][:, 2] == 1.0).all()  # no sampler log-prob: no correction
    objective.sums(model, batch)  # the loss reads it
    halves = grpo_batch.recut([batch], 2, objective.pad_id)
    torch.testing.assert_close(torch.cat([h["importance_sampling_ratio"] for h in halves]), expected)
    objective.prepare(model, [slots])
    assert engine.synced == 2  # and again before the next step's generation


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or not vllm_sampling.installed(), reason="needs CUDA and vllm")
def test_one_grpo_step_generates_with_vllm_colocated(tmp_path):
    from hf_fixtures import make_tiny_llama

    llama = make_tiny_llama(tmp_path / "base", hidden_size=256)  # head size 64: vLLM's attention kernels take it
    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"say {w}", "answer": w}) + "\n" for w in ("yes", "ok") * 4))
    out = tmp_path / "run"
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={llama}", f"data.source={source}",
         "data.format=prompts", "data.max_length=64", "rl.method=grpo", "rl.num_generations=4",
         "rl.max_completion_length=8", "rl.reward_funcs=[{function: exact_match, column: answer}]",
         "rl.use_vllm=true", "rl.vllm_mode=colocate", "rl.vllm_gpu_memory_utilization=0.2",
         "rl.vllm_enable_sleep_mode=true", "peft.method=lora", "training.micro_batch_size=4",
         "training.max_steps=2", "training.log_every_steps=1", "logging.trackers=[none]", "logging.progress=false",
         "checkpoint.enabled=false", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}"],
        capture_output=True, text=True, cwd=repo, timeout=900)
    assert done.returncode == 0, (done.stderr or done.stdout)[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2 and all(r["completions/mean_length"] > 0 for r in steps)
