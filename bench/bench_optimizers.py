"""Each optimizer on the default job: final loss, throughput, and memory against the estimate.

    python bench/bench_optimizers.py [--steps N] [NAME ...]

Every run is `overdrive train` as a user types it (the embedded default job, one process,
`optim.name=NAME`; schedule-free AdamW with `scheduler.name=constant`, as it requires), in
its own output directory under a temporary folder. Per optimizer the table gives:

- final and eval loss, mean tokens/s (metrics.jsonl)
- the optimizer state the estimator predicts (`overdrive plan --json`, memory.optimizer_bytes)
  and the state the optimizer really holds after one step on the same model (tensor bytes in
  its `state`, built by overdrive's own builder)
- the estimated total per device and the process's peak resident memory (ru_maxrss: on a CPU it
  also holds the interpreter, torch and the data, which the estimate leaves out)

No target: the table is what docs/optimizers.md quotes. `--steps` shortens the job (the
default job is 1,200 steps); the table says how many ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "optimizers.md"
NAMES = ["adamw", "sgd", "adafactor", "muon", "lion", "schedule_free_adamw", "adamw_8bit"]
EXTRA = {"schedule_free_adamw": ["scheduler.name=constant"]}


def held_state_bytes(name: str) -> int:
    """Bytes in the optimizer's state after one step on the default job's model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from overdrive.resolving import resolve
    from overdrive.training.build import optimizers

    cfg = resolve(cli=[f"optim.name={name}", *EXTRA.get(name, [])], accelerate_default=False).config
    arch = dict(cfg.model.architecture)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch.pop("model_type"), vocab_size=cfg.tokenizer.vocab_size,
                                                                  **arch))
    optimizer = optimizers.build_optimizer(model, cfg, "cpu")
    optimizers.set_mode(optimizer, "train")
    ids = torch.randint(0, cfg.tokenizer.vocab_size, (2, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    parts = getattr(optimizer, "parts", [optimizer])
    return sum(t.numel() * t.element_size() for part in parts for state in part.state.values()
               for t in state.values() if torch.is_tensor(t) and t.dim() > 0)


def run_one(name: str, steps: int, work: Path) -> dict:
    out = work / name
    items = [f"optim.name={name}", *EXTRA.get(name, []), f"training.max_steps={steps}", f"output_dir={out}",
             "logging.level=quiet", "logging.trackers=[]", "checkpoint.save_final_model=false",
             "checkpoint.enabled=false"]
    if steps < 200:
        items.append(f"training.eval_every_steps={steps}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "OVERDRIVE_"))}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "overdrive.cli", "train", *items], check=True, env=env)
    seconds = time.perf_counter() - start
    plan = json.loads(subprocess.run([sys.executable, "-m", "overdrive.cli", "plan", *items, "--json"], check=True,
                                     capture_output=True, text=True, env=env).stdout)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    rates = [r["tokens_per_s"] for r in train[1:]]
    return {"name": name, "steps": train[-1]["step"], "final_loss": train[-1]["loss"],
            "eval_loss": evals[-1]["eval_loss"] if evals else None,
            "tokens_per_s": sum(rates) / len(rates) if rates else None, "seconds": seconds,
            "est_optimizer_mb": plan["memory"]["optimizer_bytes"] / 2**20,
            "held_optimizer_mb": held_state_bytes(name) / 2**20,
            "est_total_mb": plan["memory"]["total_bytes"] / 2**20,
            "peak_rss_mb": max(r.get("peak_memory_mb") or 0 for r in train)}


def table(rows: list[dict], steps: int) -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = ["## Optimizers on the default job", "",
             f"`python bench/bench_optimizers.py --steps {steps}`: the embedded default job (GPT-2, 1.2M parameters, "
             f"stdlib text), {steps} steps, one CPU process; load average {load:.1f} on {os.cpu_count()} cores "
             "while it ran (tokens/s is this machine as loaded, not a target).", "",
             "| optimizer | final loss | eval loss | tokens/s | optimizer state: estimated / held (MB) | "
             "total: estimated / peak RSS (MB) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ev = f"{r['eval_loss']:.3f}" if r["eval_loss"] is not None else "-"
        rate = f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        lines.append(f"| {r['name']} | {r['final_loss']:.3f} | {ev} | {rate} | {r['est_optimizer_mb']:.2f} / "
                     f"{r['held_optimizer_mb']:.2f} | {r['est_total_mb']:.0f} / {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("names", nargs="*", default=NAMES)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.names:
            rows.append(run_one(name, args.steps, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    RESULTS.write_text(table(rows, args.steps))
    print(RESULTS.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
