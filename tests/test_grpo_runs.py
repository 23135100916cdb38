"""GRPO run as a user types it, on a verifiable toy task: a 2-layer Llama answers prompts of random
letters (chat turns), and a completion (at most 4 tokens) is rewarded 1 when it says "yes" (the
built-in regex reward). A random policy says it about one time in eight.

The one-process run is the reference: its mean reward climbs more than half the way to 1 within
12 steps; the same global batch split into smaller micro-batches logs its loss, gradient norm and
rewards, and so do DDP, ZeRO-3 and FSDP2 on 2 processes; killed after a checkpoint, it resumes to
the same numbers.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from checkpoint_probe import records, run, killed_then_resumed
from hf_fixtures import LETTERS, make_tiny_llama
from strategy_probe import REPO, free_port

pytestmark = pytest.mark.slow  # every test here starts processes and trains

STEPS = 12
RL = """\
data: {format: prompts, max_length: 64}
rl:
  method: grpo
  num_generations: 8
  max_completion_length: 4
  reward_funcs: [{function: regex, pattern: ".*yes.*", name: says_yes}]
training: {micro_batch_size: 8, gradient_accumulation_steps: 2, log_every_steps: 1}
optim: {lr: 1.0e-2}
scheduler: {name: constant, warmup_steps: 0}
precision: {mixed_precision: "no"}
launch: {use_cpu: true}
logging: {trackers: [none], progress: false}
"""
TRL_NAMES = ("reward", "reward_std", "rewards/says_yes/mean", "completions/mean_length", "completions/clipped_ratio",
             "entropy", "clip_ratio/region_mean", "frac_reward_zero_std")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("grpo")
    make_tiny_llama(root / "base")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as f:
        for _ in range(64):
            letters = " ".join(rng.choice(LETTERS) for _ in range(4))
            f.write(json.dumps({"prompt": [{"role": "user", "content": letters}], "answer": "yes"}) + "\n")
    (root / "rl.yaml").write_text(RL)
    return root


def command(work: Path, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "overdrive.cli", "train", str(work / "rl.yaml"), f"model.name_or_path={work / 'base'}",
            f"data.source={work / 'prompts.jsonl'}", f"data.cache_dir={work / 'cache'}", f"output_dir={work / out}",
            *extra]


REFERENCE = [f"training.max_steps={STEPS}", "checkpoint.every_steps=4"]


def logged(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in records(out) if "loss" in r}


@pytest.fixture(scope="module")
def reference(work) -> Path:
    done = run(command(work, "reference", *REFERENCE), cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"training: grpo on prompts, {STEPS} steps" in done.stdout and "reward " in done.stdout
    return work / "reference"


def test_the_mean_reward_rises_more_than_half_the_way_to_its_maximum(reference):
    steps = logged(reference)
    rewards = [steps[s]["reward"] for s in sorted(steps)]
    print("reward by step:", [round(r, 3) for r in rewards])
    assert all(name in steps[1] for name in TRL_NAMES)
    start_, end = rewards[0], sum(rewards[-3:]) / 3
    assert start_ < 0.5 and end >= start_ + 0.5 * (1.0 - start_), rewards
    assert steps[1]["completions/mean_length"] <= 4 and steps[1]["rewards/says_yes/mean"] == steps[1]["reward"]
    kept = [json.loads(line) for line in (reference / "completions.jsonl").read_text().splitlines()]
    assert len(kept) == 8 * STEPS and {"group", "prompt", "completion", "reward"} <= set(kept[0])
    assert sum(k["reward"] for k in kept[-8:]) > sum(k["reward"] for k in kept[:8])


def _same_steps(got: dict[int, dict], expected: dict[int, dict], steps) -> None:
    for step in steps:
        a, b = got[step], expected[step]
        assert a["reward"] == b["reward"] and a["completions/mean_length"] == b["completions/mean_length"], step
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (step, a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * b["grad_norm"], (step, a["grad_norm"], b["grad_norm"])


def test_the_same_global_batch_split_otherwise_or_over_two_processes_trains_the_same(work, reference):
    """A smaller micro-batch, then ZeRO-3 and FSDP2 on 2 processes (they generate with the parameters
    sharded, every rank taking each forward together; DDP's plain replicas are the loss
    normalisation tests')."""
    expected = logged(reference)
    assert expected[1]["grad_norm"] > 0
    two = ("launch.num_processes=2", "training.micro_batch_size=4", "training.gradient_accumulation_steps=2",
           "precision.mixed_precision=no")
    for name, extra in (("split", ("training.micro_batch_size=4", "training.gradient_accumulation_steps=4")),
                        ("zero3", (str(REPO / "configs/zero3.yaml"), *two)),
                        ("fsdp2", (str(REPO / "configs/fsdp.yaml"), *two))):
        done = run(command(work, name, *extra, "training.max_steps=3", "checkpoint.enabled=false",
                           "checkpoint.save_final_model=false", f"launch.main_process_port={free_port()}"),
                   cwd=work, timeout=900)
        assert done.returncode == 0, name + done.stdout[-3000:] + done.stderr[-3000:]
        got = logged(work / name)
        assert sorted(got) == [1, 2, 3] and got[1]["num_processes"] == (1 if name == "split" else 2)
        _same_steps(got, expected, (1, 2, 3))


def test_num_iterations_trains_twice_on_each_generation(work):
    """rl.num_iterations=2: step 2 updates on step 1's completions (no new rewards logged), its ratio
    against the generation-time log-probs now off 1 and clipped; step 3 generates again."""
    done = run(command(work, "iterations", "rl.num_iterations=2", "training.max_steps=3", "checkpoint.enabled=false",
                       "checkpoint.save_final_model=false"), cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = logged(work / "iterations")
    assert "reward" in got[1] and "reward" not in got[2] and "reward" in got[3]
    assert got[1]["clip_ratio/region_mean"] == 0 and got[2]["clip_ratio/region_mean"] > 0


def test_a_killed_grpo_run_resumes_exactly(work, reference):
    out = work / "killed"
    killed_then_resumed(command(work, "killed", *REFERENCE), work, out, 4, 1, timeout=900)
    got, expected = logged(out), logged(reference)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step]["loss"] == expected[step]["loss"] and got[step]["reward"] == expected[step]["reward"], step


# ---------------------------------------------------------------- the run-level guards on GRPO

SHORT = ("training.max_steps=4", "checkpoint.enabled=false", "checkpoint.save_final_model=false")
SPIKE = ("training.loss_spike.factor=2", "training.loss_spike.window=2")


def test_the_loss_spike_guard_judges_grpo_by_its_gradient_norm(work, reference, monkeypatch):
    """GRPO's loss sits near zero and goes negative: the guard judges the gradient norm. With no
    spike it skips nothing and changes nothing (the reference's losses to the bit); an injected
    one (advantages of a broken reward) is skipped."""
    done = run(command(work, "spike-clean", *SHORT, *SPIKE), cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    clean, expected = logged(work / "spike-clean"), logged(reference)
    assert [clean[s]["loss_spikes_skipped"] for s in (1, 2, 3, 4)] == [0, 0, 0, 0]
    for step in (1, 2, 3, 4):
        assert clean[step]["loss"] == expected[step]["loss"], (step, clean[step]["loss"], expected[step]["loss"])
        assert clean[step]["grad_norm"] == expected[step]["grad_norm"], step

    monkeypatch.setenv("OVERDRIVE_FAULT_INJECT", "spike:step=4")
    done = run(command(work, "spike-hit", *SHORT, *SPIKE), cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 4: gradient norm" in done.stdout and "skipped, the weights untouched" in done.stdout
    hit = logged(work / "spike-hit")
    assert [hit[s]["loss_spikes_skipped"] for s in (1, 2, 3, 4)] == [0, 0, 0, 1]
    assert hit[4]["grad_norm"] > 2 * max(hit[s]["grad_norm"] for s in (2, 3))


def test_an_out_of_memory_grpo_step_is_redone_as_a_run_started_at_half_the_micro_batch(work, monkeypatch):
    """training.oom_retry on GRPO: the completions cut again at the halved micro-batch and the slots
    laid out as that split lays them; from the redone step on, the run started at the halved split.
    Also when the memory runs out while a rank samples, on 2 processes."""
    half = run(command(work, "oom-half", *SHORT, "training.micro_batch_size=4", "training.gradient_accumulation_steps=4"),
               cwd=work, timeout=900)
    assert half.returncode == 0, half.stdout[-3000:] + half.stderr[-3000:]
    monkeypatch.setenv("OVERDRIVE_FAULT_INJECT", "oom:step=2:rank=0")
    done = run(command(work, "oom-retried", *SHORT, "training.oom_retry=true"), cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 2: out of memory at micro-batch 8; redoing it at micro-batch 4 x accumulation 4" in done.stdout
    got, expected = logged(work / "oom-retried"), logged(work / "oom-half")
    assert [got[s]["micro_batch_size"] for s in (1, 2, 3, 4)] == [8, 4, 4, 4]
    for step in (2, 3, 4):  # the reward logged once per step: the redo's metrics replace the failed attempt's
        assert got[step]["loss"] == expected[step]["loss"] and got[step]["reward"] == expected[step]["reward"], step
        assert got[step]["grad_norm"] == expected[step]["grad_norm"], step

    # Out of memory while rank 1 samples, on 2 processes: both stop the step before the rewards' gather (rank 0 never
    # waits in it for rank 1), the step is redone at the halved split, rank 1 sampling in halves: the same completions.
    monkeypatch.setenv("OVERDRIVE_FAULT_INJECT", "oom-sampling:step=2:rank=1")
    done = run(command(work, "oom-sampling", *SHORT, "training.oom_retry=true", "launch.num_processes=2",
                       "parallel.strategy=ddp", "training.micro_batch_size=4", "training.gradient_accumulation_steps=2",
                       f"launch.main_process_port={free_port()}"), cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 2: out of memory at micro-batch 4; redoing it at micro-batch 2 x accumulation 4" in done.stdout
    got = logged(work / "oom-sampling")
    assert [got[s]["micro_batch_size"] for s in (1, 2, 3, 4)] == [4, 2, 2, 2]
    _same_steps(got, expected, (1, 2, 3, 4))


def test_the_chunked_loss_kernel_gives_grpo_the_full_losses(work, reference):
    """training.loss_kernel=chunked: the completions' log-probs a slice at a time, without their
    logits; the losses, rewards and gradient norms of the run from the whole logits."""
    done = run(command(work, "chunked", *SHORT, "training.loss_kernel=chunked"), cwd=work, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _same_steps(logged(work / "chunked"), logged(reference), (1, 2, 3, 4))
