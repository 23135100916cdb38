"""Optimizers and data mixtures in real runs (slow: they start processes).

- sgd, adafactor, muon, lion and schedule-free AdamW each give the same loss at every logged
  step on 2 DDP processes as on 1, at the same global batch (relative 1e-3; measured ~2e-6).
  One launch of each world size trains all five (tests/optimizer_probe.py).
- A 70/30 mixture of two text files draws 70/30 of its tokens (within 2% after 200 steps), and
  a run killed after its checkpoint at step 100 resumes to the uninterrupted run's losses.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint_probe import checkpoint_then, command, finish, kill_group, losses, records, run, start, wait_for
from strategy_probe import GLOBAL_BATCH, losses_of

pytestmark = pytest.mark.slow

PROBE = Path(__file__).with_name("optimizer_probe.py")
OPTIMIZERS = ["sgd", "adafactor", "muon", "lion", "schedule_free_adamw"]
RELATIVE = 1e-3


def probe(out: Path, cache: Path, processes: int) -> None:
    args = [str(PROBE), "--out", str(out), "--processes", str(processes), "--micro", str(GLOBAL_BATCH // processes),
            "--cache", str(cache), *OPTIMIZERS]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "OVERDRIVE_"))}
    env["OMP_NUM_THREADS"] = "1"
    if processes > 1:
        args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes), *args]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def test_each_optimizer_gives_the_same_losses_on_two_processes(tmp_path):
    cache = tmp_path / "cache"
    probe(tmp_path / "one", cache, 1)
    probe(tmp_path / "two", cache, 2)
    for name in OPTIMIZERS:
        one, two = losses_of(tmp_path / "one" / name), losses_of(tmp_path / "two" / name)
        assert len(one) == len(two) == 4, name
        worst = max(abs(a - b) / abs(a) for a, b in zip(one, two))
        assert worst <= RELATIVE, f"{name}: one process {one}, two {two}"
        assert one[-1] < one[0] or name == "adafactor", f"{name} did not learn: {one}"


def _text(path: Path, words: list[str], lines: int, seed: int) -> None:
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(lines)))


MIX = ["training.max_steps=200", "training.micro_batch_size=8", "training.eval_every_steps=null",
       "checkpoint.every_steps=100", "data.sources=" + str([
           {"name": "greek", "source": "greek.txt", "weight": 0.7},
           {"name": "numbers", "source": "numbers.txt", "weight": 0.3}]).replace("'", '"')]


def test_a_mixture_draws_by_weight_and_resumes_exactly(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    _text(work / "greek.txt", "alpha beta gamma delta epsilon zeta eta theta iota kappa".split(), 6000, 0)
    _text(work / "numbers.txt", "one two three four five six seven eight nine ten".split(), 6000, 1)
    cache = tmp_path / "cache"
    done = run(command(work / "whole", cache, *MIX), cwd=work, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    last = [r for r in records(work / "whole") if "loss" in r][-1]
    assert last["step"] == 200
    drawn = last["source_tokens"]
    share = drawn["greek"] / (drawn["greek"] + drawn["numbers"])
    assert abs(share - 0.7) / 0.7 <= 0.02, drawn
    assert drawn["greek"] + drawn["numbers"] == last["tokens"]

    proc = start(command(work / "killed", cache, *MIX), cwd=work, freeze_after=102)
    wait_for(checkpoint_then(work / "killed", 100, 2), proc, timeout=900, what="the checkpoint at step 100")
    kill_group(proc)
    finish(proc)
    done = run(command(work / "killed", cache, *MIX), cwd=work, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    whole, resumed = losses(work / "whole"), losses(work / "killed")
    after = [step for step in whole if step > 100]
    assert after and all(resumed[step] == whole[step] for step in after)
    final = [r for r in records(work / "killed") if "loss" in r][-1]
    assert final["source_tokens"] == drawn
