"""A one-machine job whose port nobody chose takes one no other job can take: four 2-process
runs started at the same moment, beside a job that holds the default port, all train."""

from __future__ import annotations

import json
import socket

import pytest
from checkpoint_probe import command, run, start


@pytest.mark.slow
def test_four_two_process_runs_started_at_once_all_train(tmp_path):
    cache = tmp_path / "cache"
    warm = run(command(tmp_path / "warm", cache, "training.max_steps=1", "checkpoint.enabled=false"), cwd=tmp_path)
    assert warm.returncode == 0, warm.stderr[-3000:]
    with socket.socket() as held:  # another job on the default port: nobody's run may depend on it
        try:
            held.bind(("", 29500))
            held.listen()
        except OSError:
            pass  # another job on this machine holds it already: the same condition
        jobs = [start(command(tmp_path / f"run{i}", cache, "launch.num_processes=2", "launch.use_cpu=true",
                              "training.max_steps=2", "checkpoint.enabled=false"), cwd=tmp_path) for i in range(4)]
        ended = [job.communicate(timeout=400) for job in jobs]
    for i, (job, (_, err)) in enumerate(zip(jobs, ended)):
        assert job.returncode == 0, err[-3000:]
        assert "Traceback" not in err and "EADDRINUSE" not in err
        steps = [json.loads(line).get("step") for line in (tmp_path / f"run{i}" / "metrics.jsonl").read_text().splitlines()]
        assert 2 in steps
