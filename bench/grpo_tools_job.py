"""Tool-calling GRPO: overdrive's step against TRL's GRPOTrainer(tools=...) on the same job, split into
generation, tools, scoring and update, and both sides' reward curves on it (`bench_grpo.py --tools`).

The job: a lookup task whose answer needs the tool. A prompt asks `find kN`; the answer is the code the
`lookup` tool (a plain function with type hints and a docstring) returns for kN from a table the model
never sees; the reward is 1 on an exact match (overdrive's `exact_match`, the same function handed to
TRL). The model is tests/tool_fixtures.py's tiny chat Llama (a chat template that renders tools, calls
and tool messages, and a response_template both parsers read), warmed briefly on a mix of whole tool
exchanges and direct guesses, so about half the completions call the tool before any RL. LoRA (r 16,
alpha 32, every linear layer), 4 generations a prompt, 32 completions a step (8 a micro-batch, 4
accumulated), max_completion_length 24, max_tool_calling_iterations 2, loss dapo, beta 0.04, lr 5e-4
constant, fp32, one thread each.

Generation is overdrive's `timing/generation_s` less `timing/tools_s` and TRL's `_generate` less the
seconds inside the tool; tools those seconds (the same function on both sides); scoring and update as in
bench_grpo.py. `--learning N`: both sides train N steps once more and the table gives the mean reward
every 5 steps.
"""

from __future__ import annotations

import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
import bench_grpo  # noqa: E402

KEYS = [f"k{i}" for i in range(10)]
CODES = [f"v{i}" for i in range(10)]
TABLE = dict(zip(KEYS, random.Random(7).sample(CODES, len(CODES))))
TOOLS_MODULE = f'''\
TABLE = {TABLE!r}


def lookup(key: str) -> str:
    """Looks up the code of a key.

    Args:
        key: The key to look up.
    """
    return TABLE[key]
'''
JOB = {**bench_grpo.JOB, "max_completion_length": 24, "iterations": 2}


def make_job(work: Path, rows: int = 256, warm_steps: int = 250, seed: int = 0) -> None:
    """The warmed model, the prompts and the tool module `lookup_tools.py` under `work`."""
    import torch
    from tool_fixtures import make_tool_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import get_json_schema

    (work / "lookup_tools.py").write_text(TOOLS_MODULE)
    rng = random.Random(seed)
    with open(work / "prompts.jsonl", "w") as f:
        for _ in range(rows):
            key = rng.choice(KEYS)
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"find {key}"}], "answer": TABLE[key]}) + "\n")
    base = make_tool_llama(work / "base", seed=seed, hidden_size=64, words=["find", "lookup", "<function=lookup>", "<parameter=key>",
                                                           *KEYS, *CODES])
    namespace: dict = {}
    exec(TOOLS_MODULE, namespace)
    schema = [get_json_schema(namespace["lookup"])]
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)

    def exchange(key: str, called: bool) -> list[int]:
        user = {"role": "user", "content": f"find {key}"}
        if not called:  # a guess: the policy answers a code without asking (right one time in ten)
            turns = [user, {"role": "assistant", "content": rng.choice(CODES)}]
        else:
            call = {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}
            turns = [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "lookup", "content": TABLE[key]},
                     {"role": "assistant", "content": TABLE[key]}]
        return tokenizer.apply_chat_template(turns, tools=schema, tokenize=True, return_dict=True)["input_ids"]

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(seed)
    model.train()
    for _ in range(warm_steps):
        rows_ = [exchange(rng.choice(KEYS), rng.random() < 0.5) for _ in range(32)]
        width = max(map(len, rows_))
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows_])
        labels = ids.masked_fill(ids == 0, -100)
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(base)


def overdrive_config(work: Path, steps: int) -> str:
    j = JOB
    return bench_grpo.overdrive_config(work, steps).replace(
        f"max_completion_length: {bench_grpo.JOB['max_completion_length']}",
        f"max_completion_length: {j['max_completion_length']}\n  tools: [lookup_tools:lookup]\n"
        f"  max_tool_calling_iterations: {j['iterations']}").replace("max_length: 64", "max_length: 96")


def run_overdrive(work: Path, out: Path, steps: int, src: Path) -> list[dict]:
    (work / "grpo.yaml").write_text(overdrive_config(work, steps))
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{work}", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "overdrive.cli", "train", str(work / "grpo.yaml"),
                           f"output_dir={out}"], env=env, capture_output=True, text=True, timeout=1800, cwd=work)
    if done.returncode:
        raise SystemExit(f"overdrive failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_out, last = [], None
    for r in (r for r in records if "reward" in r):
        tools_s = r.get("timing/tools_s", 0.0)
        steps_out.append({"step": r["step"], "step_s": r["elapsed_s"] - last if last is not None else float("nan"),
                          "generation_s": r["timing/generation_s"] - tools_s, "tools_s": tools_s,
                          "scoring_s": r["timing/scoring_s"], "reward": r["reward"],
                          "calls": r.get("tools/call_frequency", 0.0)})
        last = r["elapsed_s"]
    return steps_out


def trl_side(work: Path, steps: int, out: Path) -> None:
    """TRL's GRPOTrainer with the lookup tool, timed, in this process (bench_grpo.trl_side)."""
    sys.path.insert(0, str(work))
    from lookup_tools import lookup

    spent: dict = {}

    @functools.wraps(lookup)
    def timed_lookup(key: str) -> str:
        started = time.perf_counter()
        try:
            return lookup(key)
        finally:
            spent["tools_s"] += time.perf_counter() - started

    bench_grpo.trl_side(work, steps, out, job=JOB, tools=(timed_lookup,), spent=spent)


def run_trl(work: Path, out: Path, steps: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(bench_grpo.SRC), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(HERE / "bench_grpo.py"), "--tools", "--side", "trl", "--work", str(work),
                           "--steps", str(steps), "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode:
        raise SystemExit(f"TRL failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


PARTS = ("step_s", "generation_s", "tools_s", "scoring_s")


def split(rows: list[dict]) -> dict[str, float]:
    m = {k: statistics.median(r[k] for r in rows) for k in PARTS}
    m["update_s"] = statistics.median(r["step_s"] - r["generation_s"] - r["tools_s"] - r["scoring_s"] for r in rows)
    return m


def curve(rows: list[dict], every: int = 5) -> list[tuple[int, float, float]]:
    """(last step, mean reward, mean tool calls a completion) of each `every` steps."""
    return [(chunk[-1]["step"], statistics.fmean(r["reward"] for r in chunk), statistics.fmean(r["calls"] for r in chunk))
            for chunk in (rows[i:i + every] for i in range(0, len(rows), every))]


def report(args, rounds: list[dict], sides: list[str], learned: dict[str, list[dict]]) -> str:
    counted = {side: [s for r in rounds for s in r[side] if s["step"] > args.skip] for side in sides}
    v = bench_grpo._version
    lines = ["## Tool-calling GRPO: overdrive against TRL's GRPOTrainer(tools=...)", "",
             f"1 thread each, torch {v('torch')}, transformers {v('transformers')}, trl {v('trl')}; the lookup job "
             f"(bench/grpo_tools_job.py); {args.rounds} interleaved rounds of {args.steps} steps, the first "
             f"{args.skip} not counted. Seconds per step, medians"
             + (f"; `before`: overdrive at {args.before_label}" if args.before else "") + ".", "",
             "| round | side | step | generation | tools | scoring | update | reward (first → last) | calls |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds, 1):
        for side in sides:
            s = split([x for x in r[side] if x["step"] > args.skip])
            rewards, calls = [x.get("reward", float("nan")) for x in r[side]], [x.get("calls", 0.0) for x in r[side]]
            lines.append(f"| {i} | {side} | {s['step_s']:.3f} | {s['generation_s']:.3f} | {s['tools_s']:.5f} | "
                         f"{s['scoring_s']:.4f} | {s['update_s']:.3f} | {rewards[0]:.2f} → {rewards[-1]:.2f} | "
                         f"{statistics.fmean(calls):.2f} |")
    for side in sides:
        s = split(counted[side])
        lines.append(f"| all | {side} | **{s['step_s']:.3f}** | {s['generation_s']:.3f} | {s['tools_s']:.5f} | "
                     f"{s['scoring_s']:.4f} | {s['update_s']:.3f} | | |")
    mine, theirs = split(counted["overdrive"]), split(counted["trl"])
    lines += ["", f"overdrive / TRL, median step: **{mine['step_s'] / theirs['step_s']:.2f}x**; generation "
              f"{mine['generation_s'] / theirs['generation_s']:.2f}x, update {mine['update_s'] / theirs['update_s']:.2f}x."]
    if args.before:
        before = split(counted["before"])
        lines.append(f"Before: {before['step_s'] / theirs['step_s']:.2f}x TRL's step, generation "
                     f"{before['generation_s'] / theirs['generation_s']:.2f}x.")
    if learned:
        curves = {side: curve(rows) for side, rows in learned.items()}
        lines += ["", f"### Mean reward over {args.learning} steps (each row: the 5 steps ending there; calls: tool "
                  "calls a completion)", "", "| steps | " + " | ".join(f"{s} reward | {s} calls" for s in curves) + " |",
                  "|---|" + "---|---|" * len(curves)]
        for row in zip(*curves.values()):
            lines.append(f"| {row[0][0]} | " + " | ".join(f"{r:.2f} | {c:.2f}" for _, r, c in row) + " |")
        start, mine_end, theirs_end = curves["overdrive"][0][1], curves["overdrive"][-1][1], curves["trl"][-1][1]
        gained = (mine_end - start) / (theirs_end - start) if theirs_end > start else float("inf")
        lines += ["", f"overdrive from {start:.2f} (first 5 steps) to {mine_end:.2f} (last 5); TRL's last 5 steps "
                  f"{theirs_end:.2f}: overdrive went {gained:.0%} of the way from its start to TRL's level "
                  "(bar: at least 50%; above 100%: past TRL's level)."]
    return "\n".join(lines) + "\n"


def main(args) -> int:
    import tempfile

    if args.side == "trl":
        trl_side(args.work, args.steps, args.out)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-grpo-tools-") as tmp:
        work = Path(tmp)
        make_job(work)
        rounds, sides = [], ["overdrive", "trl"] + (["before"] if args.before else [])
        sources = {"overdrive": bench_grpo.SRC, "before": args.before.resolve() if args.before else None}

        def one(side: str, out: Path, steps: int) -> list[dict]:
            return (run_trl(work, out.with_suffix(".json"), steps) if side == "trl"
                    else run_overdrive(work, out, steps, sources[side]))

        for i in range(args.rounds):
            r = {}
            for side in sides[i % len(sides):] + sides[:i % len(sides)]:
                r[side] = one(side, work / f"{side}-{i}", args.steps)
                print(f"round {i + 1} {side}: {split([s for s in r[side] if s['step'] > args.skip])}", flush=True)
            rounds.append(r)
        learned = {side: one(side, work / f"{side}-learning", args.learning) for side in ("overdrive", "trl")} \
            if args.learning else {}
        text = report(args, rounds, sides, learned)
    print(text)
    output = args.output if args.output != HERE / "results" / "grpo.md" else HERE / "results" / "grpo_tools.md"
    output.write_text(text)
    return 0
