"""One global batch, one loss: the loss of an optimizer step is the mean over every loss token
of the global batch, however the batch is split into micro-batch x accumulation x processes.

Chat material with assistant-only loss and answers of very different lengths (1 to 14 words),
so micro-batches hold very different numbers of loss tokens: a mean of per-micro-batch means
weighs a 2-token answer as much as a 15-token one, and the splits disagree from step 1 on.
LoRA on a 2-layer Llama saved with save_pretrained, fp32, 6 steps at a large lr; 40 rows are 5
global batches of 8, so step 5 ends the epoch and step 6 begins the next: a step's micro-batches
are drawn ahead, and the loader's end must not end a step's accumulation early.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from checkpoint_probe import run
from hf_fixtures import CHAT_WORDS, LETTERS, make_tiny_llama
from strategy_probe import free_port, losses_of

pytestmark = pytest.mark.slow  # every test here trains

STEPS = 6
RUN = ["data.format=chat", "data.max_length=64", "data.validation_fraction=0", "peft.method=lora", "peft.r=4",
       "peft.alpha=8", "training.log_every_steps=1", "training.eval_every_steps=null", "optim.lr=0.05",
       "scheduler.name=constant", "scheduler.warmup_steps=0", "precision.mixed_precision=no", "launch.use_cpu=true",
       "logging.trackers=[none]", "logging.progress=false", "logging.level=quiet", "checkpoint.enabled=false",
       "checkpoint.save_final_model=false", f"training.max_steps={STEPS}", "data.shuffle=false"]
ANSWER_WORDS = [w for w in CHAT_WORDS if not w.startswith("<")]


def make_uneven_chat(path: Path, rows: int = 64, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 10)))
            answer = " ".join(rng.choice(ANSWER_WORDS) for _ in range(rng.choice([1, 2, 14])))
            f.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loss-split")
    make_tiny_llama(root / "base")
    make_uneven_chat(root / "chat.jsonl", rows=40)
    return root


def train(work: Path, out: str, micro: int, accumulation: int, processes: int = 1, *extra: str) -> list[float]:
    argv = [sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / 'base'}",
            f"data.source={work / 'chat.jsonl'}", f"data.cache_dir={work / 'cache'}", *RUN,
            f"training.micro_batch_size={micro}", f"training.gradient_accumulation_steps={accumulation}",
            f"launch.num_processes={processes}", f"launch.main_process_port={free_port()}",
            f"output_dir={work / out}", *extra]
    done = run(argv, cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return losses_of(work / out)


def assert_same(got: list[float], expected: list[float], label: str) -> None:
    assert len(got) == len(expected) == STEPS, (label, got, expected)
    assert abs(got[0] - expected[0]) <= 1e-5 * abs(expected[0]), f"{label}, step 1: {got} vs {expected}"
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, expected))
    assert worst <= 1e-4, f"{label}: {got} vs {expected} (relative {worst:.2e})"


def test_one_global_batch_logs_one_loss_however_it_is_split(work):
    whole = train(work, "8x1", 8, 1)
    accumulated = train(work, "1x8", 1, 8)
    two_ranks = train(work, "2x1x4", 1, 4, 2)
    print(f"\nlosses 8x1 {whole}\nlosses 1x8 {accumulated}\nlosses 2 processes x1x4 {two_ranks}")
    assert whole[-1] < whole[0]  # it learns, so later steps compare trained weights
    assert_same(accumulated, whole, "1 x 8")
    assert_same(two_ranks, whole, "2 processes x 1 x 4")
    counts = [json.loads(line)["loss_tokens"] for line in (work / "8x1" / "metrics.jsonl").read_text().splitlines()]
    assert len(set(counts)) > 1  # the global batches differ in loss tokens: the material is uneven


def test_the_split_agrees_under_zero3_and_fsdp2(work):
    """ZeRO-3 (DeepSpeed's engine divides by the accumulation itself) and FSDP2 at 2 processes,
    micro-batch 1 x accumulation 4, against one process's 8 x 1."""
    whole = losses_of(work / "8x1") if (work / "8x1" / "metrics.jsonl").is_file() else train(work, "8x1", 8, 1)
    for strategy in ("zero3", "fsdp"):
        got = train(work, strategy, 1, 4, 2, f"parallel.strategy={'deepspeed' if strategy == 'zero3' else 'fsdp'}",
                    *(["parallel.deepspeed.zero_stage=3"] if strategy == "zero3" else []))
        print(f"\nlosses {strategy} 2 processes x1x4 {got}")
        assert_same(got, whole, strategy)


def test_the_split_agrees_for_plain_text_whose_data_ends_in_a_short_batch(work, tmp_path):
    """Packed text (full LoRA-free training) whose blocks do not fill a whole number of global
    batches: split 2 processes x 2 x 2 against one process's 8 x 1."""
    rng = random.Random(1)
    with open(tmp_path / "text.jsonl", "w") as f:
        for _ in range(61):
            f.write(json.dumps({"text": " ".join(rng.choice(ANSWER_WORDS + LETTERS) for _ in range(rng.randint(5, 30)))})
                    + "\n")
    (tmp_path / "base").symlink_to(work / "base")
    text = [f"data.source={tmp_path / 'text.jsonl'}", "data.format=json", "data.max_length=16", "peft.method=none",
            "optim.lr=0.01"]
    one = train(tmp_path, "text-8x1", 8, 1, 1, *text)
    split = train(tmp_path, "text-2x2x2", 2, 2, 2, *text)
    print(f"\nlosses text 8x1 {one}\nlosses text 2 processes x2x2 {split}")
    assert_same(split, one, "plain text")
