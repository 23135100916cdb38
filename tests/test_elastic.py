"""An elastic job keeps its global batch: two launchers on 127.0.0.1 as two machines of one
process each, `launch.min_machines=1`; machine 1's whole process group is killed after step
10, machine 0 rendezvouses again alone, resumes from the stop's checkpoint with twice the
accumulation, and finishes on the uninterrupted two-process run's losses."""

from __future__ import annotations

import socket
import time

import pytest
from checkpoint_probe import (command, finish, kill_group, losses, records, run, start, steps_logged, wait_for,
                              warm_cache)
from conftest import free_port

pytestmark = pytest.mark.slow  # every test here starts processes

MAX_STEPS = 24
RUN = [f"training.max_steps={MAX_STEPS}", "training.micro_batch_size=4", "training.eval_every_steps=null",
       "checkpoint.every_steps=5", "data.max_bytes=60000", "launch.threads_per_process=1"]
# Two processes against one with twice the accumulation: the same samples per step, summed in
# another order.
REL = 1e-4


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_losing_a_machine_goes_on_with_the_rest_on_the_same_losses(tmp_path):
    (tmp_path / "cache").mkdir()
    cache = warm_cache(tmp_path / "cache", RUN)
    reference = run(command(tmp_path / "reference", cache, *RUN, "launch.num_processes=2",
                            f"launch.main_process_port={free_port()}"), cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = losses(tmp_path / "reference")

    out, port = tmp_path / "run", free_port()
    shared = [*RUN, "launch.num_processes=2", "launch.num_machines=2", "launch.min_machines=1",
              "launch.main_process_ip=127.0.0.1", f"launch.main_process_port={port}"]
    # On one host whichever agent binds the port first hosts the rendezvous (on a cluster only
    # machine 0's address matches): machine 0 starts first, as it would be the host there.
    machine0 = start(command(out, cache, *shared, "launch.machine_rank=0"), cwd=tmp_path)
    wait_for(lambda: listening(port), machine0, what="machine 0's rendezvous")
    machine1 = start(command(out, cache, *shared, "launch.machine_rank=1"), cwd=tmp_path)
    wait_for(lambda: len(steps_logged(out)) >= 10, machine0, what="step 10")
    kill_group(machine1)
    killed_at = time.time()
    code, stdout, stderr = finish(machine0, timeout=600)
    finish(machine1)
    assert code == 0, stderr[-4000:]
    assert "rendezvous again with the machines still there" in stderr
    assert "keeping the global batch of 8 (micro-batch 4 x accumulation 2 x 1)" in stdout, stdout[-3000:]
    resumed_from = int(stdout.split("resumed from ")[1].split("step-")[1][:8])
    got = losses(out)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    for step in range(resumed_from + 1, MAX_STEPS + 1):
        assert abs(got[step] - expected[step]) <= REL * abs(expected[step]), (step, got[step], expected[step])
    # The time from the kill to the first step of the one-machine world (metrics.jsonl's wall time).
    first_alone = min(r["time"] for r in records(out) if r.get("num_processes") == 1 and "loss" in r)
    print(f"machine 0 resumed alone from step {resumed_from}; its first step was logged "
          f"{first_alone - killed_at:.1f} s after machine 1's kill")
