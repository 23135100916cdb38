"""The worked example of docs/vision.md: full SFT of a tiny Qwen2-VL's language model (its vision tower and
projector frozen) on 24 coloured-image rows, 4 a step, lr 0.01 constant, AdamW, on the CPU.

Two measures:

- the held-out answer accuracy over steps: the greedy answer about 30 other images (another seed's noise,
  never trained on) names their colour; a run of each length (the schedule is constant and the rows are
  drawn by the seed, so a run of 20 steps is the run of 10 continued);
- the step time against TRL's SFTTrainer on the same job (the same model, rows as prompt and completion with
  their images, the loss over the completion, the same batch, optimizer settings and steps; the tower frozen by
  `requires_grad_(False)`): rounds interleaved, the order alternating in each (other processes on a shared
  machine slow whichever runs), a run's step time the median gap between its steps after the first.

    python bench/bench_vlm_sft.py --rounds 3 --steps 30       # writes bench/results/vlm_sft.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
RUN = ["data.format=chat", "data.max_length=64", "training.micro_batch_size=4", "optim.lr=0.01",
       "scheduler.name=constant", "scheduler.warmup_steps=0", "data.validation_fraction=0", "launch.use_cpu=true",
       "precision.mixed_precision=no", "logging.trackers=[none]", "logging.progress=false", "checkpoint.enabled=false",
       "training.log_every_steps=1"]

SCRIPT = '''\
"""TRL's SFTTrainer on the overdrive run's job: the language model in full, the vision tower and projector frozen,
prompt-completion rows with their images (the loss over the completion), AdamW with overdrive's defaults."""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[5])
from datasets import Dataset
from PIL import Image
from transformers import AutoModelForImageTextToText, TrainerCallback
from trl import SFTConfig, SFTTrainer
from vlm_fixtures import processor_class_of

model_dir, data, steps, out = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
rows = [json.loads(line) for line in data.read_text().splitlines()]
dataset = Dataset.from_list([{"prompt": r["messages"][:1], "completion": r["messages"][1:],
                              "images": [Image.open(data.parent / r["images"][0]).convert("RGB")]} for r in rows])
model = AutoModelForImageTextToText.from_pretrained(model_dir)
model.model.visual.requires_grad_(False)
times, losses = [], {}


class Clock(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        times.append(time.time())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            losses[state.global_step] = logs["loss"]


args = SFTConfig(output_dir=str(out / "trl"), per_device_train_batch_size=4, max_steps=steps, learning_rate=0.01,
                 lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                 adam_epsilon=1e-8, max_grad_norm=1.0, seed=42, use_cpu=True, logging_steps=1, report_to="none",
                 save_strategy="no", max_length=64, completion_only_loss=True, dataloader_num_workers=0,
                 disable_tqdm=True)
SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=processor_class_of(model_dir),
           callbacks=[Clock()]).train()
(out / "trl.json").write_text(json.dumps({"times": times, "losses": losses}))
'''


def step_time(times: list[float]) -> float:
    """The median gap between consecutive steps, the first step (warm-up) left out."""
    return statistics.median(b - a for a, b in zip(times[1:], times[2:]))


def overdrive_run(work: Path, out: Path, steps: int, env: dict) -> tuple[float, dict[int, float]]:
    command = [sys.executable, "-m", "overdrive.cli", "train", f"model.name_or_path={work / 'qwen'}",
               f"data.source={work / 'messages.jsonl'}", *RUN, f"training.max_steps={steps}", f"output_dir={out}"]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"overdrive train failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_done = [r for r in records if "loss" in r and "step" in r and "eval_loss" not in r]
    return step_time([r["time"] for r in steps_done]), {r["step"]: r["loss"] for r in steps_done}


def trl_run(work: Path, out: Path, steps: int, env: dict) -> tuple[float, dict[int, float]]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(work / "trl_sft.py"), str(work / "qwen"), str(work / "messages.jsonl"), str(steps),
               str(out), str(TESTS)]
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"TRL's SFTTrainer failed:\n{done.stderr[-3000:]}")
    found = json.loads((out / "trl.json").read_text())
    return step_time(found["times"]), {int(k): v for k, v in found["losses"].items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="steps of each timed run")
    parser.add_argument("--curve", default="0,10,20,30,40,50,60", help="the run lengths the accuracy is read after")
    parser.add_argument("--src", help="the overdrive source tree to measure (default: the installed one)")
    parser.add_argument("--out", default=str(HERE / "results" / "vlm_sft.md"))
    args = parser.parse_args(argv)
    if args.src:
        sys.path.insert(0, args.src)
    sys.path.insert(0, str(TESTS))
    from vlm_fixtures import answer_accuracy, make_tiny_qwen2_vl, make_vision_data

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [args.src, os.environ.get("PYTHONPATH")]))}
    work = Path(tempfile.mkdtemp(prefix="bench-vlm-sft-"))
    make_tiny_qwen2_vl(work / "qwen")
    make_vision_data(work, rows=24, layout="messages")
    held_out = make_vision_data(work / "held-out", rows=30, layout="messages", seed=1)
    (work / "trl_sft.py").write_text(SCRIPT)

    curve = []
    for steps in (int(s) for s in args.curve.split(",")):
        out = work / f"curve-{steps}"
        loss = None
        if steps:
            loss = overdrive_run(work, out, steps, env)[1][steps]
        curve.append((steps, loss, answer_accuracy(out if steps else work / "qwen", held_out)))
        print(f"after {steps} steps: loss {loss}, held-out accuracy {curve[-1][2]:.3f}", flush=True)

    ours, theirs, first = [], [], {}
    for round_ in range(args.rounds):
        runs = [("overdrive", overdrive_run, ours), ("TRL", trl_run, theirs)]
        for name, run, into in (runs if round_ % 2 == 0 else runs[::-1]):
            seconds, losses = run(work, work / f"time-{name}-{round_}", args.steps, env)
            into.append(seconds)
            first.setdefault(name, losses)
            print(f"round {round_ + 1}, {name}: {seconds * 1000:.1f} ms a step", flush=True)
    write(args, curve, ours, theirs, first)
    return 0


def write(args, curve: list, ours: list[float], theirs: list[float], first: dict) -> None:
    import torch
    import transformers
    import trl

    ms = lambda values: ", ".join(f"{v * 1000:.1f}" for v in values)  # noqa: E731
    ratio = statistics.median(ours) / statistics.median(theirs)
    steps = sorted(set(first["overdrive"]) & set(first["TRL"]))[:6]
    lines = [
        "# Vision-language SFT: the worked example's held-out accuracy, and step time against TRL's SFTTrainer", "",
        "Tiny Qwen2-VL built from its Transformers config (tests/vlm_fixtures.py: 2-layer language model of width 32, "
        "1-block vision tower), full SFT of the language model, the vision tower and projector frozen; 24 rows asking "
        "the colour of a 56 x 56 image (4 image tokens), 4 rows a step, lr 0.01 constant, AdamW (weight decay 0.01, "
        "betas 0.9/0.95), fp32, CPU.",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}.", "",
        "## Held-out answer accuracy (30 images never trained on; chance 1 in 3)", "",
        "| steps | " + " | ".join(str(s) for s, _, _ in curve) + " |",
        "|---" * (len(curve) + 1) + "|",
        "| loss at that step | " + " | ".join("-" if loss is None else f"{loss:.4f}" for _, loss, _ in curve) + " |",
        "| held-out accuracy | " + " | ".join(f"{a:.3f}" for _, _, a in curve) + " |", "",
        f"## Step time against TRL's SFTTrainer ({args.steps} steps a run, {args.rounds} rounds interleaved)", "",
        "| | median ms a step | each round |", "|---|---:|---|",
        f"| overdrive train | {statistics.median(ours) * 1000:.1f} | {ms(ours)} |",
        f"| TRL SFTTrainer | {statistics.median(theirs) * 1000:.1f} | {ms(theirs)} |", "",
        f"overdrive / TRL, median: **{ratio:.2f}**.", "",
        "First losses of the first round's runs (the same rows drawn in the same order by seed 42):", "",
        "| step | " + " | ".join(str(s) for s in steps) + " |", "|---" * (len(steps) + 1) + "|",
        "| overdrive | " + " | ".join(f"{first['overdrive'][s]:.6f}" for s in steps) + " |",
        "| TRL | " + " | ".join(f"{first['TRL'][s]:.6f}" for s in steps) + " |", "",
        f"Written by `python bench/bench_vlm_sft.py --rounds {args.rounds} --steps {args.steps}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
