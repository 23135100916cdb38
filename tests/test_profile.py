"""`overdrive profile --json`: the contract, phases that add up to the step, little
communication on one process, and traces a viewer opens (Chrome trace JSON)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

pytestmark = pytest.mark.slow

TINY = ["model.architecture.n_layer=1", "model.architecture.n_embd=32", "model.architecture.n_head=2",
        "model.architecture.n_positions=64", "tokenizer.vocab_size=512", "data.max_bytes=60000", "data.max_length=32"]


def test_one_process_profile_json_adds_up_and_its_traces_open(tmp_path):
    proc = run_cli("profile", *TINY, f"output_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "--steps", "10",
                   "--warmup", "2", "--json", timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert set(report) >= {"ranks", "bottleneck", "advice", "traces"}
    (rank,) = report["ranks"]
    assert set(rank) >= {"rank", "step_s", "phases", "peak_memory_bytes"}
    phases = rank["phases"]
    assert set(phases) == {"data", "forward", "backward", "optimizer", "communication", "other"}
    assert abs(sum(phases.values()) - rank["step_s"]) <= 0.15 * rank["step_s"], rank
    # One process has nothing to exchange: what is booked as communication is the few
    # microseconds around an empty sync, plus whatever time slice the scheduler took there.
    assert phases["communication"] < 0.15 * rank["step_s"]
    assert rank["peak_memory_bytes"] > 0 and report["bottleneck"] in ("data", "compute", "communication", "memory", "host")
    for advice in report["advice"]:
        assert set(advice) == {"key", "value", "why", "expected"}
    assert any(p.endswith("trace.rank0.json") for p in report["traces"]) and len(report["traces"]) >= 2
    for path in report["traces"]:
        trace = json.loads(open(path).read())
        assert trace["traceEvents"] and any(e.get("name") == "phase:forward" for e in trace["traceEvents"])
    assert not (tmp_path / "checkpoints").exists()  # the job's own run directory is left alone
