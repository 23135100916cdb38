"""A vision-language run's checkpoints, validation loss and eval prompts (docs/vision.md): LoRA SFT on a tiny
Qwen2-VL (its vision tower and projector frozen), one process.

- killed after a checkpoint and run again, it resumes and logs the uninterrupted run's losses bit for bit;
- with rows held out (`data.validation_fraction`) and `eval.prompts` a .jsonl whose rows carry images, each
  evaluation logs the validation loss of the held-out rows and writes an answer to each prompt, asked about its
  image as `overdrive generate --image` asks (the last evaluation's answer is generate's on the saved adapter).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from checkpoint_probe import killed_then_resumed, losses, run
from vlm_fixtures import make_tiny_qwen2_vl, make_vision_data

pytestmark = pytest.mark.slow  # every test here starts processes and trains

RUN = ["data.format=chat", "data.max_length=64", "data.validation_fraction=0", "peft.method=lora", "peft.r=8",
       "peft.alpha=16", "optim.lr=0.01", "scheduler.name=constant", "scheduler.warmup_steps=0",
       "training.micro_batch_size=4", "training.log_every_steps=1", "precision.mixed_precision=no",
       "launch.use_cpu=true", "logging.trackers=[none]", "logging.progress=false",
       "checkpoint.save_final_model=false"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vlm-runs")
    make_tiny_qwen2_vl(root / "qwen")
    make_vision_data(root, rows=24, layout="messages")
    return root


def command(work: Path, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / 'qwen'}",
            f"data.source={work / 'messages.jsonl'}", *RUN, f"output_dir={work / out}", *extra]


def test_a_killed_run_resumes_with_the_uninterrupted_runs_losses(work):
    """10 steps of 4 rows over 24 rows (an epoch is 6 steps: the resumed run crosses into the second epoch's
    order), a checkpoint every 4 steps; killed once the checkpoint of step 4 and one step after it exist."""
    every = ["training.max_steps=10", "checkpoint.every_steps=4"]
    done = run(command(work, "whole", *every), cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    killed_then_resumed(command(work, "killed", *every), work, work / "killed", 4, 1, timeout=600)
    whole, resumed = losses(work / "whole"), losses(work / "killed")
    print("uninterrupted", whole, "\nresumed", resumed)
    assert sorted(resumed) == list(range(1, 11)) and resumed == whole


def test_a_run_evaluates_its_held_out_rows_and_answers_prompts_with_images(work):
    prompts = work / "asked" / "prompts.jsonl"
    prompts.parent.mkdir()
    prompts.write_text(json.dumps({"prompt": "what colour is it", "images": ["../images/0.png"]}) + "\n"
                       + json.dumps({"prompt": "what colour is it", "images": ["../images/1.png"]}) + "\n"
                       + json.dumps({"prompt": "what colour is it"}) + "\n")  # no image: text alone
    done = run(command(work, "evaluated", "training.max_steps=4", "training.eval_every_steps=2",
                       "data.validation_fraction=0.25", f"eval.prompts={prompts}", "eval.max_new_tokens=4",
                       "checkpoint.enabled=false", "checkpoint.save_final_model=true"), cwd=work, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    evaluated = [json.loads(line) for line in (work / "evaluated" / "metrics.jsonl").read_text().splitlines()]
    validation = {r["step"]: r["eval_loss"] for r in evaluated if "eval_loss" in r}
    print("validation loss", validation)
    assert sorted(validation) == [2, 4] and all(0 < v < 10 for v in validation.values())
    samples = [json.loads(line) for line in (work / "evaluated" / "samples.jsonl").read_text().splitlines()]
    print("answers", [(s["step"], s["answer"]) for s in samples])
    assert [s["step"] for s in samples] == [2, 2, 2, 4, 4, 4]
    assert all(s["prompt"] == "what colour is it" and s["answer"].strip() for s in samples)
    asked = run([sys.executable, "-m", "overdrive.cli", "generate", str(work / "evaluated"), "what colour is it",
                 "--image", str(work / "images" / "1.png"), "--max-new-tokens", "4", "--json"], cwd=work, timeout=300)
    assert asked.returncode == 0, asked.stderr[-2000:]
    assert json.loads(asked.stdout.strip().splitlines()[-1])["answer"] == samples[4]["answer"]  # the last step's
