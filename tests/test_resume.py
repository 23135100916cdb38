"""Exact resume in one process: SIGKILL, run the same command again, get the uninterrupted
run's losses bit for bit (dropout on, gradient accumulation, an epoch boundary crossed after
the resume); a corrupt newest checkpoint and a save killed half-way are skipped; a changed
config is judged before anything loads."""

from __future__ import annotations

import json
import shutil

import pytest
from checkpoint_probe import (checkpoint_then, command, finish, kill_group, losses, records, run, start,
                              steps_logged, wait_for, warm_cache)

pytestmark = pytest.mark.slow  # every test here starts processes or trains

MAX_STEPS = 36
# ~13 optimizer steps per epoch: the resumed part of the run crosses epoch boundaries.
RUN = [f"training.max_steps={MAX_STEPS}", "data.max_bytes=40000", "training.micro_batch_size=8",
       "training.gradient_accumulation_steps=2", "training.eval_every_steps=8", "training.eval_batches=2",
       "checkpoint.every_steps=5", "checkpoint.keep_last=3"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return warm_cache(tmp_path_factory.mktemp("resume-cache"), RUN)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """The uninterrupted run."""
    work = tmp_path_factory.mktemp("reference")
    proc = run(command(work / "run", cache, *RUN), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work / "run"


def manifest_hashes(run_dir, step):
    manifest = json.loads((run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").read_text())
    return {name: entry["sha256"] for name, entry in manifest["files"].items() if name != "trainer_state.json"}


@pytest.fixture(scope="module")
def killed(tmp_path_factory, cache):
    """The same run, SIGKILLed a few steps after its checkpoint of step 10."""
    work = tmp_path_factory.mktemp("killed")
    out = work / "run"
    proc = start(command(out, cache, *RUN), cwd=work, freeze_after=13)
    wait_for(checkpoint_then(out, 10, 3), proc, what="checkpoint 10 and three more steps")
    kill_group(proc)
    code, _, _ = finish(proc)
    assert code == -9
    logged = losses(out)
    assert max(logged) > 10 and max(logged) < MAX_STEPS  # killed after the checkpoint, before the end
    return work, out, logged


def test_sigkill_then_the_same_command_resumes_bit_for_bit(reference, killed, cache):
    work, out, before_resume = killed
    copy = work / "copy"  # kept for the corruption test below
    shutil.copytree(out, copy)
    proc = run(command(out, cache, *RUN), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed_at = max(int(p.name[5:]) for p in (copy / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert f"resumed from {out / 'checkpoints' / f'step-{resumed_at:08d}'}" in proc.stdout

    expected, got = losses(reference), losses(out)
    # Every step once, in order: what was logged after the checkpoint was cut off, not repeated.
    assert steps_logged(out) == list(range(1, MAX_STEPS + 1))
    # Bit for bit, every step after the resume (and the steps the killed run logged past it).
    assert {s: got[s] for s in got if s > resumed_at} == {s: expected[s] for s in expected if s > resumed_at}
    assert all(before_resume[s] == expected[s] for s in before_resume)
    epochs = {r["step"]: r["epoch"] for r in records(out) if "loss" in r}
    assert epochs[MAX_STEPS] > epochs[resumed_at + 1]  # epoch boundaries crossed after the resume
    evals = lambda run_dir: [(r["step"], r["eval_loss"]) for r in records(run_dir) if "eval_loss" in r]  # noqa: E731
    assert evals(out) == evals(reference)
    # The final weights and optimizer state are the same bytes.
    assert manifest_hashes(out, MAX_STEPS) == manifest_hashes(reference, MAX_STEPS)


def test_a_corrupt_checkpoint_and_a_half_written_save_are_skipped(reference, killed, cache):
    work, _, _ = killed
    source = work / "copy"
    assert source.exists(), "runs after the SIGKILL test (module order)"
    out = work / "corrupt"
    shutil.copytree(source, out)
    checkpoints = out / "checkpoints"
    complete = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step-"))
    newest, previous = complete[-1], complete[-2]  # how far the killed run got before SIGKILL varies
    data = bytearray((newest / "optimizer.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 tells
    (newest / "optimizer.bin").write_bytes(bytes(data))
    # A save killed half-way: its temp dir, part of its files, no manifest.
    partial = checkpoints / f".tmp-step-{int(newest.name[5:]) + 5:08d}"
    partial.mkdir(exist_ok=True)  # the SIGKILL may have landed in that very save
    (partial / "model.safetensors").write_bytes(b"\0" * 1000)

    proc = run(command(out, cache, *RUN), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipping {newest.name}: optimizer.bin does not match its sha256" in proc.stdout
    assert f"resumed from {previous}" in proc.stdout
    assert losses(out) == losses(reference)
    assert steps_logged(out) == list(range(1, MAX_STEPS + 1))
    # The killed save's leftovers are cleaned up; the corrupt checkpoint was replaced by a good
    # one when its step came round again, then pruned (keep_last=3).
    from overdrive.checkpoint import store

    assert not partial.exists()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000030", "step-00000035", "step-00000036"]
    assert all(store.verify(p).ok for p in checkpoints.iterdir())


def test_a_changed_config_is_judged_before_anything_loads(reference, cache, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    shutil.rmtree(out / "checkpoints" / f"step-{MAX_STEPS:08d}")  # an unfinished run: step 35 of 36
    changed = run(command(out, cache, *RUN, "optim.lr=1e-3", "training.seed=7"), cwd=tmp_path)
    assert changed.returncode == 2
    assert "optim.lr: 0.003 -> 0.001" in changed.stderr and "training.seed: 42 -> 7" in changed.stderr
    assert "--force" in changed.stderr and "Traceback" not in changed.stderr
    # Harmless changes are listed, and the run goes on.
    again = run(command(out, cache, *RUN, "training.eval_every_steps=4", "logging.level=normal"), cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "training.eval_every_steps: 8 -> 4" in again.stdout and "resumed from" in again.stdout
    assert steps_logged(out) == list(range(1, MAX_STEPS + 1))
    assert losses(out) == losses(reference)


def test_sigterm_saves_where_it_stops_and_resumes_exactly(reference, cache, tmp_path):
    out = tmp_path / "run"
    proc = start(command(out, cache, *RUN), cwd=tmp_path)
    wait_for(lambda: len(steps_logged(out)) >= 7, proc, what="step 7")
    kill_group(proc, sig=15)
    code, stdout, stderr = finish(proc)
    assert code == 128 + 15, stderr[-3000:]
    stopped = max(steps_logged(out))
    assert stopped < MAX_STEPS
    assert (out / "checkpoints" / f"step-{stopped:08d}" / "manifest.json").exists()
    assert f"stopping after step {stopped}: received SIGTERM" in stdout
    assert "To resume, run the same command again" in stderr and "overdrive train" in stderr
    proc = run(command(out, cache, *RUN), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(out) == losses(reference)
    assert steps_logged(out) == list(range(1, MAX_STEPS + 1))
