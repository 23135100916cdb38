"""Toy runs shared by the strategy and launch tests.

The toy-size overrides, `overdrive train` as a user types it (in a fresh interpreter), the
losses a run logged, and the one-process reference losses (computed once per session).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import free_port  # noqa: F401  (handed on to the tests that import it from here)


REPO = Path(__file__).resolve().parents[1]
# Tiny GPT-2, no dropout, a few hundred KB of the stdlib as data, 4 steps at lr 1e-2 (so the
# loss moves), fp32 (so strategies can agree to float rounding), nothing saved.
TOY = [
    "model.architecture.n_layer=2", "model.architecture.n_embd=32", "model.architecture.n_head=2",
    "model.architecture.resid_pdrop=0", "model.architecture.embd_pdrop=0", "model.architecture.attn_pdrop=0",
    "data.max_length=32", "data.max_bytes=300000", "tokenizer.vocab_size=512",
    "training.max_steps=4", "training.log_every_steps=1", "training.eval_every_steps=null",
    "training.gradient_accumulation_steps=1", "optim.lr=1e-2", "scheduler.warmup_steps=0",
    "precision.mixed_precision=no", "logging.trackers=[]", "logging.level=quiet",
    "checkpoint.save_final_model=false", "launch.use_cpu=true",
]
GLOBAL_BATCH = 8
# Per-step loss agreement between strategies, absolute, fp32. Measured differences are ~1e-6.
TOLERANCE = 1e-4


def train(*items: str, output_dir: Path, cache_dir: Path, timeout: float = 300,
          wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    """`overdrive train FILES... TOY... OVERRIDES...` in a new process (warm_start when it runs
    to its end here; a fresh interpreter for a Popen the test watches)."""
    files = [item for item in items if "=" not in item]
    overrides = [item for item in items if "=" in item]  # after TOY, so they win over it
    argv = [sys.executable, "-m", "overdrive.cli", "train", *files, *TOY, *overrides, f"output_dir={output_dir}",
            f"data.cache_dir={cache_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "OVERDRIVE_"))}
    if not wait:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    from warm_start import run_overdrive

    return run_overdrive(argv[3:], env, REPO, timeout)


def losses_of(output_dir: Path) -> list[float]:
    lines = (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record]


def reference_losses(base: Path) -> list[float]:
    """One process, plain PyTorch path, micro-batch = the global batch. Cached per session."""
    out = base / "reference"
    if not (out / "metrics.jsonl").is_file():
        done = train(str(REPO / "configs" / "ddp.yaml"), "launch.num_processes=1",
                     f"training.micro_batch_size={GLOBAL_BATCH}", output_dir=out, cache_dir=base / "cache")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return losses_of(out)
