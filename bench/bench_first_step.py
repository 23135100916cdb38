"""Time to the first step, whole process: `overdrive train` against a plain Accelerate script
doing the same job (the same model, data, batch and optimizer), each started as a user would
start it, in a fresh interpreter, with warm caches (the token cache and tokenizer filled once
before the first pair, as a script's author would have them on disk).

The clock starts when the process is started and stops when step 1 is done: for overdrive
its metrics.jsonl record of step 1, for the script its line after `optimizer.step()`. For
overdrive the longest time without a line on stdout or stderr before step 1 is reported too.
Pairs are run one after the other (the order alternating, other processes on a shared
machine slow whichever runs); the table reports medians.

    python bench/bench_first_step.py --pairs 5                       # writes bench/results/first_step.md
    python bench/bench_first_step.py --pairs 5 --src /path/to/src    # another tree's overdrive (a baseline)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN = ["model.architecture.n_layer=2", "model.architecture.n_embd=128", "model.architecture.n_head=2",
       "tokenizer.vocab_size=2048", "data.max_length=128", "data.max_bytes=2000000", "training.micro_batch_size=8",
       "training.max_steps=1", "training.log_every_steps=1", "training.eval_every_steps=null",
       "checkpoint.enabled=false", "checkpoint.save_final_model=false", "logging.trackers=[none]",
       "logging.progress=false", "launch.num_processes=1"]

SCRIPT = '''\
"""A plain Accelerate script: the same model, data and optimizer as the overdrive run."""
import sys, time
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import GPT2Config, GPT2LMHeadModel
from overdrive import data as data_mod
from overdrive.resolving import resolve
from overdrive.training.build.tokenizer import build_tokenizer

cfg = resolve([], cli=sys.argv[1:], env={}, accelerate_default=False).config
accelerator = Accelerator(cpu=True)
tokenizer, tokens = data_mod.prepare(cfg, build_tokenizer)  # the warm token cache, as a script would keep it
set_seed(cfg.training.seed)
a = cfg.model.architecture
model = GPT2LMHeadModel(GPT2Config(n_layer=a["n_layer"], n_embd=a["n_embd"], n_head=a["n_head"],
                                   n_positions=cfg.data.max_length, vocab_size=len(tokenizer)))
optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, fused=True)
loader = torch.utils.data.DataLoader(tokens.train, batch_size=cfg.training.micro_batch_size, shuffle=True,
                                     drop_last=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
model.train()
for batch in loader:
    loss = model(**batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step 1 done, loss {loss.item():.3f}", flush=True)
    break
'''


def timed(command: list[str], env: dict, done, cwd: Path) -> tuple[float, float]:
    """(seconds to `done()`, longest silence before it) for one process, run to its end."""
    start = time.monotonic()
    proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    selector.register(proc.stderr, selectors.EVENT_READ)
    last, silence, first_step, streams = start, 0.0, None, 2
    while streams:
        for key, _ in selector.select(timeout=0.02):
            line = key.fileobj.readline()
            if not line:
                selector.unregister(key.fileobj)
                streams -= 1
                continue
            if first_step is None:
                silence, last = max(silence, time.monotonic() - last), time.monotonic()
        if first_step is None and done():
            first_step = time.monotonic() - start
            silence = max(silence, time.monotonic() - last)
    if proc.wait() != 0 or first_step is None:
        raise SystemExit(f"{' '.join(command)} failed (exit {proc.returncode})")
    return first_step, silence


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--src", help="the overdrive source tree to measure (default: the installed one)")
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "overdrive-first-step-cache"))
    parser.add_argument("--out", default=str(HERE / "results" / "first_step.md"))
    args = parser.parse_args(argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OVERDRIVE_DATA__CACHE_DIR": args.cache_dir}
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join([args.src, env.get("PYTHONPATH", "")])
    work = Path(tempfile.mkdtemp(prefix="first-step-"))
    (work / "script.py").write_text(SCRIPT)
    cli = [sys.executable, "-m", "overdrive.cli", "train", *RUN, f"data.cache_dir={args.cache_dir}"]
    subprocess.run([*cli, f"output_dir={work / 'warm'}"], env=env, cwd=work, check=True, capture_output=True)
    ours, theirs, silences = [], [], []
    for pair in range(args.pairs):
        out = work / f"run{pair}"
        metrics = out / "metrics.jsonl"

        def stepped() -> bool:
            try:
                return any(json.loads(line).get("step") == 1 for line in metrics.read_text().splitlines() if line)
            except (OSError, ValueError):
                return False

        for name in (("overdrive", "script") if pair % 2 == 0 else ("script", "overdrive")):
            if name == "script":
                theirs.append(_script_run(work, RUN, args.cache_dir, env))
            else:
                seconds, silence = timed([*cli, f"output_dir={out}"], env, stepped, work)
                ours.append(seconds)
                silences.append(silence)
        print(f"pair {pair + 1}: overdrive {ours[-1]:.2f} s (silent at most {silences[-1]:.2f} s), "
              f"script {theirs[-1]:.2f} s", file=sys.stderr)
    write(args, ours, theirs, silences)
    return 0


def _script_run(work: Path, run: list[str], cache_dir: str, env: dict) -> float:
    """The script's time to its `step 1 done` line."""
    seen: dict[str, float] = {}
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(work / "script.py"), *run, f"data.cache_dir={cache_dir}"], env=env,
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("step 1 done") and "at" not in seen:
            seen["at"] = time.monotonic() - start
    if proc.wait() != 0 or "at" not in seen:
        raise SystemExit(f"the plain script failed (exit {proc.returncode})")
    return seen["at"]


def write(args, ours: list[float], theirs: list[float], silences: list[float]) -> None:
    import torch

    ratio = statistics.median(ours) / statistics.median(theirs)
    lines = [
        "# Time to the first step: `overdrive train` vs a plain Accelerate script",
        "",
        f"Whole process, from start to step 1 done; warm caches; {len(ours)} pairs, order alternating. "
        f"Model: gpt2 2 layers x 128 wide, micro-batch 8 x 128 tokens, fused AdamW, CPU.",
        f"Machine: {platform.machine()}, torch {torch.__version__}, {os.cpu_count()} CPUs.",
        "",
        "| | median s | all pairs |",
        "|---|---:|---|",
        f"| overdrive train | {statistics.median(ours):.2f} | {', '.join(f'{s:.2f}' for s in ours)} |",
        f"| plain Accelerate script | {statistics.median(theirs):.2f} | {', '.join(f'{s:.2f}' for s in theirs)} |",
        f"| overdrive: longest silence before step 1 | {statistics.median(silences):.2f} | "
        f"{', '.join(f'{s:.2f}' for s in silences)} |",
        "",
        f"overdrive / script, median: **{ratio:.2f}**.",
        "",
        f"Written by `python bench/bench_first_step.py --pairs {args.pairs}` on {time.strftime('%Y-%m-%d %H:%M')}.",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
