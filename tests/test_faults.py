"""Faults in two-process jobs over gloo: a rank SIGKILLed (the job ends fast, naming it; with
max_restarts the job heals itself and ends on the uninterrupted run's loss), SIGTERM sent to
the launcher (every rank stops after the same step and saves), and exact resumes under DDP,
ZeRO-3 and FSDP2."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time

import pytest
from checkpoint_probe import (assert_same_losses, checkpoint_then, command, finish, kill_group, losses, run, start,
                              steps_logged, wait_for, warm_cache, worker_pids)
from conftest import free_port

pytestmark = pytest.mark.slow  # every test here starts processes or trains

MAX_STEPS = 24
RUN = [f"training.max_steps={MAX_STEPS}", "training.micro_batch_size=4", "training.eval_every_steps=null",
       "checkpoint.every_steps=5", "launch.num_processes=2", "data.max_bytes=60000"]
# Two processes on two shared cores: the same math as uninterrupted, up to the order of a
# few float sums when a strategy reshards. Measured: bitwise equal for DDP and ZeRO-3 and
# FSDP2 resumed against themselves; the cross-strategy comparison (FSDP2 against DDP) is
# the one that needs this tolerance.
CROSS_STRATEGY_REL = 1e-5


def job(out, cache, *extra):
    return command(out, cache, *RUN, f"launch.main_process_port={free_port()}", *extra)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # One process with one thread: the peak-FLOPS cache key of each of the two workers.
    one = [r for r in RUN if "num_processes" not in r] + ["launch.threads_per_process=1"]
    return warm_cache(tmp_path_factory.mktemp("faults-cache"), one)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache):
    """The uninterrupted two-process DDP run."""
    work = tmp_path_factory.mktemp("reference")
    proc = run(job(work / "run", cache), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "run"


@pytest.fixture(scope="module")
def reference(reference_run):
    return losses(reference_run)


def kill_rank(out, rank: int) -> float:
    pids = worker_pids(out)
    assert set(pids) == {0, 1}, pids
    os.kill(pids[rank], signal.SIGKILL)
    return time.monotonic()


def test_a_dead_rank_is_restarted_and_the_job_ends_on_the_uninterrupted_loss(reference, cache, tmp_path):
    out = tmp_path / "run"
    proc = start(job(out, cache, "launch.max_restarts=1"), cwd=tmp_path)
    wait_for(checkpoint_then(out, 10, 2), proc, what="checkpoint 10 and two more steps")
    kill_rank(out, 1)
    code, stdout, stderr = finish(proc)
    assert code == 0, stderr[-3000:]
    # From checkpoint 10, or a later one when the run got that far while rank 1 was being found and killed.
    resumed = re.search(r"resumed from \S*/step-(\d{8})", stdout)
    assert resumed and int(resumed.group(1)) >= 10, stdout[-2000:]
    assert steps_logged(out) == list(range(1, MAX_STEPS + 1))
    got = losses(out)
    assert_same_losses(reference, got, range(11, MAX_STEPS + 1))  # bitwise: same strategy, same world
    assert got[MAX_STEPS] == reference[MAX_STEPS]


def test_a_killed_rank_ends_the_job_within_seconds_naming_it_then_zero3_resumes_exactly(cache, tmp_path):
    out = tmp_path / "run"
    # ZeRO-3 steps are the slowest on CPU (many small gathers): a shorter run, compared with itself.
    args = job(out, cache, "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3", "training.max_steps=12")
    proc = start(args, cwd=tmp_path)
    wait_for(checkpoint_then(out, 5, 3), proc, what="checkpoint 5 and three more steps")
    killed_at = kill_rank(out, 1)
    code, _, stderr = finish(proc, timeout=180)
    seconds = time.monotonic() - killed_at
    print(f"job ended {seconds:.1f}s after rank 1's SIGKILL")
    assert code == 1
    # A few seconds on a quiet machine (the agent's monitor tick and three interpreters ending);
    # the bound leaves room for a loaded one. What must not happen is the agent's wait for the
    # survivor ending in SIGKILL: the survivor was stopped by SIGTERM and left by itself.
    assert seconds < 60
    assert "rank 0 (SIGKILL)" not in stderr, stderr[-3000:]
    assert "rank 1 (local rank 1" in stderr and "was killed by SIGKILL" in stderr
    newest = max(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    saved_at = int(newest[5:])
    assert "To resume, run the same command again" in stderr and f"last checkpoint is {out}/checkpoints/{newest}" in stderr
    before = losses(out)
    assert max(before) >= saved_at

    again = run(args, cwd=tmp_path)  # the same command (the port is a harmless change)
    assert again.returncode == 0, again.stderr[-3000:]
    after = losses(out)
    assert steps_logged(out) == list(range(1, 13))
    assert_same_losses(before, after, [s for s in before if s > saved_at])  # bitwise against itself


def test_sigterm_to_the_launcher_stops_every_rank_after_the_same_step_then_fsdp2_resumes(reference, cache, tmp_path):
    out = tmp_path / "run"
    args = job(out, cache, "parallel.strategy=fsdp")
    proc = start(args, cwd=tmp_path)
    wait_for(lambda: len(steps_logged(out)) >= 7, proc, what="step 7")
    os.kill(proc.pid, signal.SIGTERM)  # the launcher only: it must pass it on
    code, stdout, stderr = finish(proc, timeout=120)
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    stopped = max(steps_logged(out))
    assert stopped < MAX_STEPS
    saved = out / "checkpoints" / f"step-{stopped:08d}"
    assert (saved / "manifest.json").exists()
    # Both ranks wrote their shard and their RNG state at the same step.
    assert (saved / "random_states_0.pkl").exists() and (saved / "random_states_1.pkl").exists()
    assert f"stopping after step {stopped}: received SIGTERM" in stdout
    assert not worker_pids(out)

    again = run(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert steps_logged(out) == list(range(1, MAX_STEPS + 1))
    assert_same_losses(reference, losses(out), range(1, MAX_STEPS + 1), rel=CROSS_STRATEGY_REL)
    kill_group(proc)


def test_a_different_world_size_keeps_the_global_batch(reference_run, reference, cache, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference_run, out)
    shutil.rmtree(out / "checkpoints" / f"step-{MAX_STEPS:08d}")  # resume from step 20
    one_process = command(out, cache, *[r for r in RUN if "num_processes" not in r])
    proc = run(one_process, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 -> 1 processes: keeping the global batch of 8 (micro-batch 4 x accumulation 2 x 1)" in proc.stdout
    resumed = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r][-4:]
    assert [(r["step"], r["num_processes"], r["gradient_accumulation_steps"]) for r in resumed] == [
        (step, 1, 2) for step in range(21, MAX_STEPS + 1)]
    # The same samples per step, from the same data position. Dropout masks are drawn by one
    # RNG stream instead of two, which moves the loss by ~5e-4 (a wrong data position moves
    # it by ~1e-2).
    assert_same_losses(reference, losses(out), range(21, MAX_STEPS + 1), rel=2e-3)
    origin = json.loads((out / "resolved.json").read_text())["origins"]["training.gradient_accumulation_steps"]
    assert origin.startswith("resume")
