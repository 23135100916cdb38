"""What the median pruner saves: the same 8-trial sweep with `sweep.pruner=median` and `none`.

The random sampler with one seed gives both sweeps the same trial values, so the difference
is the pruner's alone: trials stopped, optimizer steps not run, wall time, and whether the
best value found changed. Writes bench/results/sweep.md.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

RESULTS = Path(__file__).resolve().parent / "results" / "sweep.md"
TRIALS = 8
JOB = {
    "model": {"architecture": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64,
                               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}},
    "tokenizer": {"vocab_size": 512},
    "data": {"max_bytes": 200_000, "max_length": 32, "validation_fraction": 0.2},
    "training": {"micro_batch_size": 8, "max_steps": 40, "eval_every_steps": 5, "eval_batches": 2, "log_every_steps": 5},
    "scheduler": {"warmup_steps": 4},
    "checkpoint": {"enabled": False, "save_final_model": False},
    "logging": {"trackers": ["none"], "progress": False},
    "sweep": {"trials": TRIALS, "sampler": "random", "seed": 3,
              "space": {"optim.lr": {"low": 1e-5, "high": 3e-2, "log": True}}},
}


def sweep(root: Path, pruner: str) -> dict:
    import optuna

    job = yaml.safe_load(yaml.safe_dump(JOB))
    job["sweep"]["pruner"] = pruner
    job["data"]["cache_dir"] = str(root / "cache")
    job["output_dir"] = str(root / pruner)
    config = root / f"{pruner}.yaml"
    config.write_text(yaml.safe_dump(job))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "overdrive.cli", "sweep", str(config)], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"sweep with pruner {pruner} failed:\n{done.stderr[-3000:]}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=pruner, storage=f"sqlite:///{root / pruner / 'sweep.db'}")
    trials = study.get_trials()
    return {"pruner": pruner, "seconds": seconds, "steps": sum(t.user_attrs.get("steps", 0) for t in trials),
            "pruned": sum(t.state.name == "PRUNED" for t in trials), "best": study.best_value,
            "best_lr": study.best_params["optim.lr"],
            "trials": [(t.number, t.state.name, t.user_attrs.get("steps"), t.params["optim.lr"]) for t in trials]}


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    try:
        rows = [sweep(root, "none"), sweep(root, "median")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    none, median = rows
    lines = [f"# Sweep: steps saved by the median pruner ({TRIALS} trials, {JOB['training']['max_steps']} steps each, "
             f"evaluated every {JOB['training']['eval_every_steps']})", "",
             "Same random-sampler seed, so both sweeps try the same learning rates. Optuna's MedianPruner with its "
             "defaults (5 startup trials, no warm-up steps).", "",
             "| pruner | trials pruned | optimizer steps run | wall s | best eval_loss | best lr |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['pruner']} | {r['pruned']} | {r['steps']} | {r['seconds']:.0f} | {r['best']:.4f} | "
                     f"{r['best_lr']:.3g} |")
    saved = none["steps"] - median["steps"]
    lines += ["", f"Steps saved: {saved} of {none['steps']} ({saved / none['steps']:.0%}).", "",
              "| trial | lr | steps (none) | steps (median) | state (median) |", "| --- | --- | --- | --- | --- |"]
    for (n, _, steps_none, lr), (_, state, steps_median, _) in zip(none["trials"], median["trials"]):
        lines.append(f"| {n} | {lr:.3g} | {steps_none} | {steps_median} | {state} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
