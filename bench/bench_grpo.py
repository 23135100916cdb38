"""GRPO step time: overdrive's against TRL's GRPOTrainer on the same job, split into generation, scoring
and update.

The job: a small Llama (built from a LlamaConfig, word-level tokenizer, saved locally), warmed by a
short supervised pass on the task so a sampled answer is right about half the time; chat prompts of
five letters whose answer is the first one (`--answer-letters 5`: all five, a longer completion),
rewarded 1 on an exact match (overdrive's built-in
`exact_match`, the same function handed to TRL); LoRA (r 16, alpha 32, every linear layer), 4
generations a prompt, 32 completions a step (8 a micro-batch, 4 accumulated: one generation call of
32 in TRL), max_completion_length 8, loss dapo, beta 0.04 (the reference's forward in both), lr
5e-4 constant, AdamW (0.9, 0.999, no decay), fp32, one thread each (the machine's cores are shared:
more threads there measured slower, every op waiting on the others').

Each side trains `--steps` steps in a process of its own; the first `--skip` steps are start-up and
not counted. A step's time is overdrive's `elapsed_s` between metrics.jsonl records (logged every
step) and TRL's between on_step_begin and on_step_end; generation is overdrive's
`timing/generation_s` and TRL's `_generate` (wrapped), scoring `timing/scoring_s` and TRL's
`_calculate_rewards`, the update the rest (the reference's and the policy's forwards, backward,
optimizer). The sides run interleaved for `--rounds` rounds, in an order that rotates; the table
reports each round's medians and the median over all counted steps.

    python bench/bench_grpo.py                       # writes bench/results/grpo.md; exit 1 above the target
    python bench/bench_grpo.py --before OLD/src      # and another checkout's overdrive, a third side each round
    python bench/bench_grpo.py --tools --learning 40 # the tool-calling job (grpo_tools_job.py), reward curves too
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
TARGET = 0.8  # overdrive's median step over TRL's, at most; exit 1 above
LETTERS = list("abcdefgh")
WORDS = ["<system>", "<user>", "<assistant>", *LETTERS]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
JOB = dict(num_generations=4, max_completion_length=8, beta=0.04, loss_type="dapo", lr=5e-4, micro=8, accumulate=4,
           temperature=1.0, lora_r=16, lora_alpha=32)


def make_job(work: Path, answer_letters: int = 1, rows: int = 256, seed: int = 0) -> float:
    """The model (warmed) and prompts under `work`; returns the warmed model's mean probability of the answer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<eos>", bos_token="<eos>")
    tokenizer.chat_template = TEMPLATE
    rng = random.Random(seed)
    data = []
    for _ in range(rows):
        letters = [rng.choice(LETTERS) for _ in range(5)]
        data.append({"prompt": [{"role": "user", "content": " ".join(letters)}],
                     "answer": " ".join(letters[:answer_letters])})
    with open(work / "prompts.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in data)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(vocab),
                                         max_position_embeddings=64, pad_token_id=0, eos_token_id=2, bos_token_id=2))
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for r in data]
    answers = [[vocab[w] for w in r["answer"].split()] + [2] for r in data]
    ids = torch.tensor([p + a for p, a in zip(prompts, answers)])
    labels = ids.clone()
    labels[:, :len(prompts[0])] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start, probability = len(prompts[0]), 0.0
    for _ in range(600):  # until a sampled answer (its letters) is right about half the time
        with torch.no_grad():
            logps = model(ids).logits[:, start - 1:-2].log_softmax(-1)
            said = logps.gather(2, ids[:, start:-1, None]).squeeze(-1).sum(-1)
            probability = said.exp().mean().item()
        if probability >= 0.45:
            break
        model(ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(work / "base")
    tokenizer.save_pretrained(work / "base")
    return probability


def overdrive_config(work: Path, steps: int) -> str:
    j = JOB
    return f"""\
model: {{name_or_path: {work / 'base'}}}
data: {{source: {work / 'prompts.jsonl'}, format: prompts, max_length: 64, cache_dir: {work / 'cache'}}}
rl:
  method: grpo
  num_generations: {j['num_generations']}
  max_completion_length: {j['max_completion_length']}
  beta: {j['beta']}
  loss_type: {j['loss_type']}
  temperature: {j['temperature']}
  reward_funcs: [{{function: exact_match, column: answer}}]
peft: {{method: lora, r: {j['lora_r']}, alpha: {j['lora_alpha']}, target_modules: all-linear}}
training: {{micro_batch_size: {j['micro']}, gradient_accumulation_steps: {j['accumulate']}, max_steps: {steps},
           log_every_steps: 1, eval_every_steps: null}}
optim: {{lr: {j['lr']}, weight_decay: 0.0, betas: [0.9, 0.999]}}
scheduler: {{name: constant, warmup_steps: 0}}
precision: {{mixed_precision: "no"}}
launch: {{use_cpu: true, threads_per_process: 1}}
checkpoint: {{enabled: false, save_final_model: false}}
logging: {{trackers: [none], progress: false}}
"""


def run_overdrive(work: Path, out: Path, steps: int, src: Path) -> list[dict]:
    (work / "grpo.yaml").write_text(overdrive_config(work, steps))
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "overdrive.cli", "train", str(work / "grpo.yaml"),
                           f"output_dir={out}"], env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"overdrive failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "reward" in r]
    steps_out, last = [], None
    for r in records:
        if last is not None:
            steps_out.append({"step": r["step"], "step_s": r["elapsed_s"] - last, "generation_s": r["timing/generation_s"],
                              "scoring_s": r["timing/scoring_s"], "reward": r["reward"]})
        last = r["elapsed_s"]
    return steps_out


def trl_side(work: Path, steps: int, out: Path, job: dict = JOB, tools: tuple = (), spent: dict | None = None) -> None:
    """TRL's GRPOTrainer on the job, in this process; its per-step times written to `out`. `tools`: TRL's
    `tools` (grpo_tools_job.py), whose seconds they add to `spent["tools_s"]`, taken out of generation."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(SRC))
    from overdrive.training.objectives.rewards import exact_match

    torch.set_num_threads(1)
    j = job
    spent = spent if spent is not None else {}
    spent.update(generation_s=0.0, scoring_s=0.0, tools_s=0.0)
    rows = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
    args = GRPOConfig(output_dir=str(out.parent / "trl_out"), per_device_train_batch_size=j["micro"],
                      gradient_accumulation_steps=j["accumulate"], num_generations=j["num_generations"],
                      max_completion_length=j["max_completion_length"], beta=j["beta"], loss_type=j["loss_type"],
                      learning_rate=j["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                      temperature=j["temperature"], max_steps=steps, logging_steps=1, save_strategy="no",
                      report_to=[], use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0,
                      **({"max_tool_calling_iterations": j["iterations"]} if tools else {}))
    trainer = GRPOTrainer(model=str(work / "base"), reward_funcs=exact_match("answer"), args=args,
                          train_dataset=Dataset.from_list(rows), tools=list(tools) or None,
                          peft_config=LoraConfig(r=j["lora_r"], lora_alpha=j["lora_alpha"], target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))

    def timed(name, function):
        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spent[name] += time.perf_counter() - started
        return wrapper

    trainer._generate = timed("generation_s", trainer._generate)
    trainer._calculate_rewards = timed("scoring_s", trainer._calculate_rewards)
    measured = []

    class Steps(TrainerCallback):
        def on_step_begin(self, *_, **__):
            spent.update(generation_s=0.0, scoring_s=0.0, tools_s=0.0, started=time.perf_counter())

        def on_step_end(self, _args, state, *_, **__):
            measured.append({"step": state.global_step, "step_s": time.perf_counter() - spent["started"],
                             "generation_s": spent["generation_s"] - spent["tools_s"], "tools_s": spent["tools_s"],
                             "scoring_s": spent["scoring_s"]})

        def on_log(self, _args, state, control, logs=None, **__):
            if logs and "reward" in logs and measured:
                measured[-1]["reward"] = logs["reward"]
                measured[-1]["calls"] = logs.get("tools/call_frequency", 0.0)

    trainer.add_callback(Steps())
    trainer.train()
    out.write_text(json.dumps(measured))


def run_trl(work: Path, out: Path, steps: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--side", "trl", "--work", str(work), "--steps", str(steps),
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise SystemExit(f"TRL failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def split(rows: list[dict]) -> dict[str, float]:
    m = {k: statistics.median(r[k] for r in rows) for k in ("step_s", "generation_s", "scoring_s")}
    m["update_s"] = statistics.median(r["step_s"] - r["generation_s"] - r["scoring_s"] for r in rows)
    return m


def table(args, probability: float, rounds: list[dict], sides: list[str]) -> tuple[str, float]:
    counted = {side: [s for r in rounds for s in r[side] if s["step"] > args.skip] for side in sides}
    mine, theirs = split(counted["overdrive"]), split(counted["trl"])
    ratio = mine["step_s"] / theirs["step_s"]
    lines = ["## GRPO step: overdrive against TRL's GRPOTrainer", "",
             f"{platform.processor() or platform.machine()}, 1 thread each, torch {_version('torch')}, "
             f"transformers {_version('transformers')}, trl {_version('trl')}; {args.rounds} interleaved rounds of "
             f"{args.steps} steps, the first {args.skip} not counted; the warmed model's mean probability of the "
             f"answer ({args.answer_letters} letter(s) and end-of-sequence) {probability:.2f}. Seconds per step, medians"
             + (f"; `before`: overdrive at {args.before_label}" if args.before else "") + ".", "",
             "| round | side | step | generation | scoring | update | reward (first → last) |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds, 1):
        for side in sides:
            rows = [s for s in r[side] if s["step"] > args.skip]
            s = split(rows)
            rewards = [x.get("reward", float("nan")) for x in r[side]]
            lines.append(f"| {i} | {side} | {s['step_s']:.3f} | {s['generation_s']:.3f} | {s['scoring_s']:.4f} | "
                         f"{s['update_s']:.3f} | {rewards[0]:.2f} → {rewards[-1]:.2f} |")
    for side in sides:
        s = split(counted[side])
        lines.append(f"| all | {side} | **{s['step_s']:.3f}** | {s['generation_s']:.3f} | {s['scoring_s']:.4f} | "
                     f"{s['update_s']:.3f} | |")
    verdict = "met" if ratio <= TARGET else "missed"
    lines += ["", f"overdrive / TRL, median step: **{ratio:.2f}x** (target at most {TARGET}x: {verdict}); "
              f"generation {mine['generation_s'] / theirs['generation_s']:.2f}x, update "
              f"{mine['update_s'] / theirs['update_s']:.2f}x."]
    if args.before:
        before = split(counted["before"])
        lines.append(f"Before this change: {before['step_s'] / theirs['step_s']:.2f}x TRL's step, generation "
                     f"{before['generation_s'] / theirs['generation_s']:.2f}x.")
    lines.append("")
    return "\n".join(lines), ratio


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--answer-letters", type=int, default=1, help="letters in an answer (1 to 5)")
    parser.add_argument("--before", type=Path, help="another overdrive checkout's src/, timed as a third side")
    parser.add_argument("--before-label", default="the other checkout", help="what --before is, for the table")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "grpo.md")
    parser.add_argument("--tools", action="store_true",
                        help="the tool-calling job instead (grpo_tools_job.py; writes bench/results/grpo_tools.md)")
    parser.add_argument("--learning", type=int, default=0,
                        help="with --tools: both sides train this many steps once more, their reward curves reported")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tools:
        sys.path.insert(0, str(HERE))
        import grpo_tools_job

        return grpo_tools_job.main(args)
    if args.side == "trl":
        trl_side(args.work, args.steps, args.out)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        work = Path(tmp)
        probability = make_job(work, args.answer_letters)
        rounds, sides = [], ["overdrive", "trl"] + (["before"] if args.before else [])
        sources = {"overdrive": SRC, "before": args.before.resolve() if args.before else None}
        for i in range(args.rounds):
            r = {}
            for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                out = work / f"{side}-{i}"
                r[side] = (run_trl(work, out.with_suffix(".json"), args.steps) if side == "trl"
                           else run_overdrive(work, out, args.steps, sources[side]))
                print(f"round {i + 1} {side}: {split([s for s in r[side] if s['step'] > args.skip])}", flush=True)
            rounds.append(r)
        text, ratio = table(args, probability, rounds, sides)
    print(text)
    args.output.write_text(text)
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
