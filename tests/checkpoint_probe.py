"""Helpers for the resume and fault tests: start `overdrive train` as a user would, watch its
metrics.jsonl, find its worker processes, and kill them at a chosen point."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

# A tiny GPT-2 with dropout left on (so restoring the RNG states matters), every step logged.
TINY = ["model.architecture.n_layer=1", "model.architecture.n_embd=32", "model.architecture.n_head=2",
        "model.architecture.n_positions=64", "tokenizer.vocab_size=512", "data.max_bytes=200000",
        "data.max_length=32", "optim.lr=3e-3", "scheduler.warmup_steps=3", "training.log_every_steps=1",
        "logging.trackers=[none]", "logging.progress=false", "checkpoint.save_final_model=false"]


def command(out: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "overdrive.cli", "train", *TINY, f"data.cache_dir={cache}", f"output_dir={out}",
            *extra]


def warm_cache(cache: Path, run_args: list[str]) -> Path:
    """Fill the tokenizer, token and peak-FLOPS caches once. The first run in an empty cache
    also measures the CPU's peak FLOPS, which draws from the global RNG: runs compared bit for
    bit must all find the cache filled."""
    proc = run(command(cache / "warm-up", cache, *run_args, "training.max_steps=1", "checkpoint.enabled=false"),
               cwd=cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cache


def start(args: list[str], cwd: Path, freeze_after: Optional[int] = None) -> subprocess.Popen:
    """The job in its own session: the whole job (launcher, agent, workers) can be killed as one
    group, as losing a machine would. `freeze_after`: it stops after that step and waits for the
    kill (OVERDRIVE_FAULT_INJECT=freeze), so a kill meant for the middle of the run lands there
    however fast a machine runs the steps."""
    env = {**os.environ, "OVERDRIVE_FAULT_INJECT": f"freeze:step={freeze_after}"} if freeze_after else None
    return subprocess.Popen(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command to its end, its output caught; `overdrive` ones through warm_start."""
    from warm_start import run_overdrive

    if args[:3] == [sys.executable, "-m", "overdrive.cli"]:
        return run_overdrive(args[3:], dict(os.environ), cwd, timeout)
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return found


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(out) if "loss" in r}


def steps_logged(out: Path) -> list[int]:
    return [r["step"] for r in records(out) if "loss" in r]


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, timeout: float = 240, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited ({proc.returncode}) before {what}:\n{out[-2000:]}\n{err[-4000:]}")
        if time.monotonic() > deadline:
            kill_group(proc)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def checkpoint_then(out: Path, step: int, more: int) -> Callable[[], bool]:
    """True once the checkpoint of `step` exists and `more` further steps are logged."""
    final = out / "checkpoints" / f"step-{step:08d}"

    def ready() -> bool:
        logged = steps_logged(out)
        return final.is_dir() and bool(logged) and logged[-1] >= step + more
    return ready


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def worker_pids(out: Path) -> dict[int, int]:
    """rank -> pid of the `overdrive train --resolved` workers training into `out` (Linux /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--resolved" not in cmdline or not any(str(out).encode() in part for part in cmdline):
            continue
        env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(entry)
    return found


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def killed_then_resumed(command: list[str], cwd: Path, out: Path, step: int, more: int,
                        timeout: float = 600) -> subprocess.CompletedProcess:
    """The run SIGKILLed (its whole group) once the checkpoint of `step` and `more` steps after it
    exist, then the same command run again to its end: the resumed run, which said it resumed."""
    proc = start(command, cwd=cwd, freeze_after=step + more)
    wait_for(checkpoint_then(out, step, more), proc, timeout=timeout, what=f"checkpoint {step} and {more} more steps")
    kill_group(proc)
    assert finish(proc)[0] == -9
    done = run(command, cwd=cwd, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout
    return done


def assert_same_losses(reference: dict[int, float], resumed: dict[int, float], steps, rel: Optional[float] = None):
    for step in steps:
        if rel is None:
            assert resumed[step] == reference[step], (step, resumed[step], reference[step])
        else:
            assert abs(resumed[step] - reference[step]) <= rel * abs(reference[step]), (step, resumed[step],
                                                                                         reference[step])
