"""A frozen rank: the watchdog names it, shows where the others wait, ends the job, and the
last checkpoint resumes. Two processes over gloo, rank 1 SIGSTOPped after step 10."""

from __future__ import annotations

import os
import signal
import time

import pytest
from overdrive.observe.heartbeat import read_beats
from checkpoint_probe import checkpoint_then, command, finish, kill_group, run, start, steps_logged, wait_for, worker_pids
from conftest import free_port

pytestmark = pytest.mark.slow

MAX_STEPS = 16


def test_a_frozen_rank_is_named_with_the_waiting_ranks_stack_and_the_job_resumes(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = command(out, cache, f"training.max_steps={MAX_STEPS}", "training.micro_batch_size=4",
                   "training.eval_every_steps=null", "checkpoint.every_steps=5", "launch.num_processes=2",
                   "data.max_bytes=60000", "launch.hang_timeout_s=20", f"launch.main_process_port={free_port()}")
    proc = start(args, cwd=tmp_path)
    try:
        wait_for(checkpoint_then(out, 10, 0), proc, what="the checkpoint of step 10")
        pids = worker_pids(out)
        os.kill(pids[1], signal.SIGSTOP)
        frozen_at = time.monotonic()
        time.sleep(0.5)
        frozen_step = read_beats(out)[1].step  # where rank 1 is, from its live record
        code, _, stderr = finish(proc, timeout=120)
        took = time.monotonic() - frozen_at
    finally:
        kill_group(proc)
    assert code != 0, stderr[-3000:]
    assert took < 90, f"{took:.0f} s"
    assert "the job is hung" in stderr, stderr[-3000:]
    stuck = next(line for line in stderr.splitlines() if "stuck: rank 1" in line)
    assert frozen_step >= 10 and "stopped" in stuck and f"(after step {frozen_step})" in stuck, stuck
    # Rank 0 answered with its Python stack, inside the training loop where it waits.
    assert "waiting: rank 0" in stderr
    stack = stderr.split("Python stack of rank 0", 1)[1]
    assert "training/loop.py" in stack and "rank 1 did not answer" in stderr, stderr[-4000:]
    # The last checkpoint is whole, and the same command resumes from it to the end. Which one
    # it is depends on how far the run got while rank 1 was being found and stopped (10 or later).
    newest = max(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert int(newest[5:]) >= 10, newest
    again = run(args, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and newest in again.stdout, again.stdout[-2000:]
    assert steps_logged(out)[-1] == MAX_STEPS
