"""A 2-process run whose rank 1 is slowed names rank 1 as the straggler, in the run's output
and in `overdrive report`.

Rank 1 is slowed by being stopped for 30 ms and let run for 10 (SIGSTOP/SIGCONT), periods shorter
than one step so that every logging window is slowed alike: with 0.1 s each, a window of four
~30 ms steps sometimes fell between two stops and broke the three windows in a row the watch asks
for, and at one half speed a busy machine brought the ratio down to 1.2 in some windows. On this kind
of virtual machine, pinning it to a core shared with busy loops slows the other core as much
(a loop on core 0 ran 3x slower with core 1 busy), so both ranks slowed alike."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from checkpoint_probe import (command, finish, kill_group, records, start, steps_logged, wait_for,
                              worker_pids)
from conftest import free_port, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # one rank slowed, judged against the other


def slow_down(pid: int, done: threading.Event, stopped_s: float = 0.03, running_s: float = 0.01) -> None:
    while not done.is_set():
        try:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(stopped_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)
        except ProcessLookupError:
            return


def test_a_slowed_rank_is_named_the_straggler_in_the_output_and_the_report(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    args = command(out, cache, "training.max_steps=40", "training.micro_batch_size=16", "model.architecture.n_embd=128",
                   "model.architecture.n_layer=2", "training.log_every_steps=4", "training.eval_every_steps=null",
                   "checkpoint.enabled=false", "launch.num_processes=2", "launch.threads_per_process=1",
                   "data.max_bytes=60000", f"launch.main_process_port={free_port()}")
    proc = start(args, cwd=tmp_path)
    done = threading.Event()
    try:
        wait_for(lambda: len(steps_logged(out)) >= 1, proc, what="the first logged step")
        rank1 = worker_pids(out)[1]
        threading.Thread(target=slow_down, args=(rank1, done), daemon=True).start()
        code, stdout, stderr = finish(proc, timeout=300)
    finally:
        done.set()
        kill_group(proc)
    assert code == 0, stderr[-3000:]
    windows = [(r["step"], r["rank_compute_s"]) for r in records(out) if "rank_compute_s" in r]
    assert "straggler: rank 1" in stdout, f"compute per step of each rank, by logged step: {windows}\n{stdout[-1500:]}"
    report = run_cli("report", str(out), timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "straggler: rank 1" in report.stdout and "1 (straggler)" in report.stdout, report.stdout[-3000:]
    assert "| 1 (straggler) |" in (out / "report" / "summary.md").read_text()
