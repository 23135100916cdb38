"""A trial that crashes and one that hangs are recorded and skipped; the tuner finishes and
leaves no process behind."""

from __future__ import annotations

import json

import psutil
import pytest
import yaml

from overdrive.resolving import resolve
from overdrive.tune import TrialPlan, TuneOptions, make_job, run
from overdrive.tune.space import Option
from overdrive.tune.trials import _failure
from conftest import free_port

TINY = {
    "model": {"architecture": {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 64}},
    "tokenizer": {"vocab_size": 512},
    "data": {"max_bytes": 60_000, "max_length": 32},
    "training": {"micro_batch_size": 8, "max_steps": 40},
    "scheduler": {"warmup_steps": 2},
    "launch": {"threads_per_process": 1},
}


def test_exit_codes_and_logs_are_classified():
    assert _failure(-9, "")[0] == "oom"  # the kernel's OOM killer
    assert _failure(1, "RuntimeError: DefaultCPUAllocator: can't allocate memory")[0] == "oom"
    status, reason = _failure(1, "Traceback ...\nValueError: bad value")
    assert status == "crashed" and reason.endswith("ValueError: bad value")


@pytest.mark.slow
def test_a_crashing_and_a_hanging_trial_are_reported_and_skipped(tmp_path):
    data = json.loads(json.dumps(TINY))
    data["data"]["cache_dir"] = str(tmp_path / "cache")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    plan = TrialPlan.measuring(0.2, startup_timeout_s=20)
    only = {"batch": ["8"], "precision": ["no"], "compile": ["eager"], "workers": ["0"], "threads": ["1"]}
    job = make_job(resolve([tmp_path / "run.yaml"]), TuneOptions(only=only, plan=plan, workdir=tmp_path))
    port = free_port()
    # Injected as options of one dimension. The crash: a value that fails once the model is
    # built. The hang: a second machine that never joins the rendezvous.
    job.space.dimensions["threads"] += [
        Option("threads", "threads 1 crash", (("launch.threads_per_process", 1),
                                              ("model.attn_implementation", "no_such_kernel"))),
        Option("threads", "threads 1 hang", (("launch.threads_per_process", 1), ("launch.num_machines", 2),
                                             ("launch.num_processes", 2), ("launch.main_process_ip", "127.0.0.1"),
                                             ("launch.main_process_port", port))),
    ]
    lines: list[str] = []
    result = run(job, log=lines.append)

    by_threads = {c["options"]["threads"]: c for c in result["candidates"] if c["status"] != "dominated"}
    crash, hang = by_threads["threads 1 crash"], by_threads["threads 1 hang"]
    assert crash["status"] == "crashed" and "no_such_kernel" in crash["reason"]
    assert "ValueError" in crash["log_tail"]
    assert hang["status"] == "timeout" and "no training step within 20 s" in hang["reason"], (hang["reason"], hang.get("log_tail"))
    assert result["chosen"] == result["baseline"]  # the tuner finished and kept what worked
    assert by_threads["threads 1"]["status"] == "ok"
    assert any("crashed" in line for line in lines) and any("timeout" in line for line in lines)
    # Killed with everything it started: no launcher agent is left waiting on that port.
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(port) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
