"""`overdrive launch SCRIPT`: a user's own Accelerate script with a bare `Accelerator()`
gets the configured strategy, precision and accumulation, at 2 CPU processes over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from strategy_probe import REPO, free_port

pytestmark = pytest.mark.slow  # every test here starts processes or trains

SCRIPT = REPO / "tests" / "user_script_probe.py"
# ZeRO-3 with parameters and optimizer states offloaded to CPU memory (DeepSpeedCPUAdam).
RUNS = {"ddp": "ddp.yaml", "deepspeed": "zero3-offload.yaml", "fsdp": "fsdp.yaml"}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """One launch per strategy, shared by the tests below."""
    base = tmp_path_factory.mktemp("user_scripts")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_", "OVERDRIVE_"))}
    found = {}
    for name, config in RUNS.items():
        out = base / f"{name}.json"
        done = subprocess.run(
            [sys.executable, "-m", "overdrive.cli", "launch", "-c", str(REPO / "configs" / config),
             "-s", "training.gradient_accumulation_steps=2", "-s", "launch.use_cpu=true",
             "-s", f"launch.main_process_port={free_port()}", "-s", f"output_dir={base / name}",
             str(SCRIPT), str(out), "--a-flag-for-the-script"],
            capture_output=True, text=True, timeout=300, env=env)
        found[name] = (done, json.loads(out.read_text()) if out.is_file() else None)
    return found


@pytest.mark.parametrize("name, distributed_type", [("ddp", "MULTI_CPU"), ("deepspeed", "DEEPSPEED"), ("fsdp", "FSDP")])
def test_bare_accelerator_sees_the_configured_values(reports, name, distributed_type):
    done, report = reports[name]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["distributed_type"] == distributed_type
    assert report["num_processes"] == 2
    assert report["mixed_precision"] == "bf16"  # from the shipped configs
    assert report["gradient_accumulation_steps"] == 2  # from -s
    assert report["argv"][1:] == ["--a-flag-for-the-script"]
    if name == "deepspeed":
        assert report["zero_stage"] == 3 and report["ds_bf16"] is True
        assert report["offload"] == ["cpu", "cpu"]
    if name == "fsdp":
        assert report["fsdp_version"] == 2
    assert all(loss == loss for loss in report["losses"])  # trained, finite


@pytest.mark.parametrize("name", ["deepspeed", "fsdp"])
def test_each_rank_holds_about_half_the_parameters(reports, name):
    """ZeRO-3 and FSDP2 shard the GPT-2: each of the 2 ranks holds ~1/2 of its elements."""
    _, report = reports[name]
    assert len(report["fraction"]) == 2
    for fraction in report["fraction"]:
        assert 0.45 <= fraction <= 0.55, report["fraction"]
    assert reports["ddp"][1]["fraction"] == [1.0, 1.0]
