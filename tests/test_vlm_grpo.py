"""GRPO with image prompts (docs/vision.md, "GRPO"): prompts of turns with an image part and an `images` column,
the completions text, the rewards given the row's other columns (here the image's colour).

Slow: the prompt's images reach the forward over the completions (the log-probs move when the image changes);
a few steps of LoRA GRPO on a tiny Qwen2-VL and of full GRPO (with its KL reference) on a tiny LLaVA run, the
rewards read from the row's `colour` column, the completions written as text; under FSDP2 and ZeRO-3 on 2 processes
the one-process losses and rewards.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from vlm_fixtures import make_vision_prompts, make_tiny_models

REWARD = '''def colour(completions, colour, **kwargs):
    return [1.0 if c in t[0]["content"] else 0.0 for c, t in zip(colour, completions)]
'''
RUN = ["data.format=prompts", "rl.method=grpo", "rl.num_generations=4", "rl.max_completion_length=8",
       'rl.reward_funcs=[{function: "colour_reward:colour"}]', "data.max_length=64", "training.micro_batch_size=4",
       "training.max_steps=3", "optim.lr=0.01", "scheduler.name=constant", "scheduler.warmup_steps=0",
       "launch.use_cpu=true", "precision.mixed_precision=no", "logging.trackers=[none]", "logging.progress=false",
       "checkpoint.enabled=false", "training.log_every_steps=1"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm-grpo")
    make_tiny_models(root)
    make_vision_prompts(root, rows=8)
    (root / "colour_reward.py").write_text(REWARD)
    return root


@pytest.mark.slow
def test_the_prompts_image_reaches_the_forward_over_the_completions(work):
    from overdrive.data.vision_prompts import image_inputs
    from overdrive.resolving.resolve import resolve
    from overdrive.training.objectives.grpo import completion_logps
    from overdrive.training.objectives.grpo_batch import completion_batch
    from overdrive.training.build.model import build_model
    from overdrive.training.build.vision import prompts, settle

    for name in ("qwen", "llava"):
        cfg = resolve([], cli=[f"model.name_or_path={work / name}", f"data.source={work / 'prompts.jsonl'}", *RUN],
                      env={}, accelerate_default=False).config
        tokenizer, data = prompts(cfg, settle(cfg)[1])
        ps = data.prompts
        batch = completion_batch([ps.prompt_ids[0], ps.prompt_ids[1]], [[12, 13, 14], [15]], torch.zeros(2),
                                 tokenizer.pad_token_id, "cpu")
        batch.update(image_inputs(ps, [0, 1], batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1], "cpu"))
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        with torch.no_grad():
            logps = completion_logps(model, batch, 1.0)[0]
            other = completion_logps(model, {**batch, "pixel_values": batch["pixel_values"].flip(0) + 1.0}, 1.0)[0]
        moved = (logps - other).abs()[batch["completion_mask"] == 1]
        assert (moved > 1e-7).all(), (name, moved)  # every completion token sees its row's image


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [("qwen", ["peft.method=lora", "peft.r=8", "peft.alpha=16"]),
                                        ("llava", ["rl.beta=0.04", "rl.num_iterations=2", "training.oom_retry=true"])],
                         ids=["qwen2-vl-lora", "llava-full-kl-oom-redo"])
def test_grpo_with_image_prompts_runs_and_rewards_read_the_rows_columns(work, name, extra, monkeypatch):
    """The LLaVA run runs out of memory at step 2 (injected), whose completions are kept from step 1 for a second
    update (rl.num_iterations=2): they are cut again at the halved micro-batch with their prompts' images."""
    from checkpoint_probe import records, run

    out = work / f"grpo-{name}"
    if "training.oom_retry=true" in extra:
        monkeypatch.setenv("OVERDRIVE_FAULT_INJECT", "oom:step=2:rank=0")
    done = run([sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / name}",
                f"data.source={work / 'prompts.jsonl'}", *RUN, f"output_dir={out}", *extra], cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [r for r in records(out) if "reward" in r]
    print(name, [(r["step"], round(r["loss"], 4), r["reward"]) for r in steps])
    assert [r["step"] for r in steps] == ([1, 3] if "rl.num_iterations=2" in extra else [1, 2, 3])
    if "training.oom_retry=true" in extra:  # step 2 updated on step 1's completions (no reward of its own)
        trained = [r for r in records(out) if "loss" in r]
        assert [(r["step"], r["micro_batch_size"]) for r in trained] == [(1, 4), (2, 2), (3, 2)]
        monkeypatch.delenv("OVERDRIVE_FAULT_INJECT")  # against a run started at the halved split
        half = run([sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / name}",
                    f"data.source={work / 'prompts.jsonl'}", *RUN, f"output_dir={out}-half", *extra,
                    "training.micro_batch_size=2", "training.gradient_accumulation_steps=2"], cwd=work, timeout=600)
        assert half.returncode == 0, half.stdout[-3000:] + half.stderr[-3000:]
        expected = [r for r in records(work / f"grpo-{name}-half") if "loss" in r]
        for got, want in zip(trained, expected):
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-7), (got, want)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (got, want)
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert samples and all(isinstance(s["completion"][0]["content"], str) for s in samples)
    assert any(s["reward"] for s in samples) or all(r["reward"] == 0 for r in steps)


@pytest.mark.slow
def test_grpo_with_image_prompts_under_fsdp2_and_zero3_gives_the_one_process_losses(work):
    """The sharded policy generates with its images: FSDP2 gathers its root unit's parameters (the vision tower's
    patch embedding among them) around generate (training/generation/sampling.py), ZeRO-3 each module's in its
    hook. Full GRPO on the tiny LLaVA under FSDP2 (its layer classes those the model holds: CLIP also names
    CLIPTextEmbeddings) and LoRA on the tiny Qwen2-VL under ZeRO-3, 8 completions a step: one process at 4 a
    micro-batch, 2 accumulated, against 2 processes at 4 each; the same losses and rewards over 3 steps."""
    from checkpoint_probe import records, run
    from strategy_probe import free_port

    def train(name: str, out: str, *extra: str) -> list[tuple[float, float]]:
        done = run([sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / name}",
                    f"data.source={work / 'prompts.jsonl'}", *RUN, f"output_dir={work / out}", *extra],
                   cwd=work, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return [(r["loss"], r["reward"]) for r in records(work / out) if "reward" in r]

    lora, two = ["peft.method=lora", "peft.r=8", "peft.alpha=16"], ["launch.num_processes=2"]
    pairs = {"fsdp2, llava, full": (
                 train("llava", "grpo-llava-one", "training.gradient_accumulation_steps=2"),
                 train("llava", "grpo-llava-fsdp2", *two, "parallel.strategy=fsdp",
                       f"launch.main_process_port={free_port()}")),
             "zero3, qwen2-vl, lora": (
                 train("qwen", "grpo-qwen-one", *lora, "training.gradient_accumulation_steps=2"),
                 train("qwen", "grpo-qwen-zero3", *lora, *two, "parallel.strategy=deepspeed",
                       "parallel.deepspeed.zero_stage=3", f"launch.main_process_port={free_port()}"))}
    for name, (one, steps) in pairs.items():
        print(name, one, steps)
        assert len(one) == 3 and len(steps) == 3, name
        for (loss, reward), (their_loss, their_reward) in zip(one, steps):
            assert their_loss == pytest.approx(loss, abs=1e-5) and their_reward == reward, (name, one, steps)
