"""`overdrive env`: the Accelerate default config in effect, run variables, secrets masked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from overdrive.config.env_report import accelerate_default_config_path, masked_value, run_variables

BIN = Path(sys.executable).parent / "overdrive"
OVERDRIVE = [str(BIN)] if BIN.exists() else [sys.executable, "-m", "overdrive.cli"]
STALE_DEFAULT = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
mixed_precision: bf16
num_machines: 1
num_processes: 2
"""


def shell(tmp_path: Path, default_config: str | None = STALE_DEFAULT) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "OVERDRIVE_", "HF_"))}
    home = tmp_path / "hf"
    if default_config is not None:
        (home / "accelerate").mkdir(parents=True)
        (home / "accelerate" / "default_config.yaml").write_text(default_config)
    env.update(HF_HOME=str(home), ACCELERATE_MIXED_PRECISION="fp16", HF_TOKEN="secret",
               WANDB_API_KEY="secret", HF_ENDPOINT="https://user:secret@hub.example", OMP_NUM_THREADS="2")
    return env


def overdrive_env(env: dict[str, str], *flags: str) -> str:
    result = subprocess.run(OVERDRIVE + ["env", *flags], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
def test_markdown_report(tmp_path):
    out = overdrive_env(shell(tmp_path))
    assert "secret" not in out
    for heading in ("### Versions", "### Hardware", "### Accelerate default config",
                    "### Environment variables that affect a run"):
        assert heading in out
    for package in ("| python |", "| overdrive |", "| torch |", "| accelerate |", "| transformers |", "| deepspeed |",
                    "| datasets |", "| tokenizers |", "| pydantic |"):
        assert package in out
    assert "- CPU:" in out and "- RAM:" in out and ("- GPUs:" in out or "| GPU |" in out)
    # The default config in effect: its path and content...
    path = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    assert f"In effect: `{path}`" in out and "distributed_type: FSDP" in out
    # ...what it changes in overdrive's values, including one the environment overrides...
    assert "| parallel.strategy | `fsdp` | `ddp` |" in out
    assert "| precision.mixed_precision | `bf16` | `no` | overridden by env ACCELERATE_MIXED_PRECISION |" in out
    assert "| launch.num_processes | `2` | `1` |" in out
    # ...and the variables that change a run, secrets masked.
    assert "| ACCELERATE_MIXED_PRECISION | `fp16` |" in out
    assert "| OMP_NUM_THREADS | `2` |" in out
    assert "| HF_TOKEN | `***` |" in out and "| HF_ENDPOINT | `https://***@hub.example` |" in out
    assert "WANDB_API_KEY" not in out  # not a variable that changes a run
    assert "| precision.mixed_precision | `fp16` | `no` | ACCELERATE_MIXED_PRECISION |" in out


@pytest.mark.slow
def test_json_and_no_default_config(tmp_path):
    env = shell(tmp_path, default_config=None)
    text = overdrive_env(env, "--json", "--no-hardware")
    assert "secret" not in text
    report = json.loads(text)
    assert report["accelerate_default_config"] == {
        "path": str(tmp_path / "hf" / "accelerate" / "default_config.yaml"), "exists": False, "content": None}
    variables = {v["name"]: v["value"] for v in report["environment"]}
    assert variables["ACCELERATE_MIXED_PRECISION"] == "fp16" and variables["HF_TOKEN"] == "***"
    assert report["versions"]["accelerate"] and report["hardware"] is None
    assert "None in effect" in overdrive_env(env, "--no-hardware")


def test_masking_and_selection():
    env = {"HF_TOKEN": "t", "MY_SECRET": "s", "NCCL_DEBUG": "INFO", "HOME": "/root", "PATH": "/bin",
           "DS_ACCELERATOR": "cpu", "FSDP_CPU_RAM_EFFICIENT_LOADING": "1", "OVERDRIVE_TRAINING__MAX_STEPS": "5",
           "TORCH_LOGS": "+dynamo", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "LOCAL_RANK": "0",
           "OVERDRIVE_DB_PASSWORD": "pw", "HTTPS_PROXY": "http://u:p@proxy:3128"}
    listed = dict(run_variables(env))
    assert "HOME" not in listed and "PATH" not in listed and "MY_SECRET" not in listed
    assert listed["HF_TOKEN"] == "***" and listed["OVERDRIVE_DB_PASSWORD"] == "***"
    assert listed["NCCL_DEBUG"] == "INFO" and listed["DS_ACCELERATOR"] == "cpu" and listed["LOCAL_RANK"] == "0"
    assert {"FSDP_CPU_RAM_EFFICIENT_LOADING", "OVERDRIVE_TRAINING__MAX_STEPS", "TORCH_LOGS",
            "PYTORCH_CUDA_ALLOC_CONF"} <= set(listed)
    assert masked_value("HTTPS_PROXY", "http://u:p@proxy:3128") == "http://***@proxy:3128"
    assert masked_value("AWS_ACCESS_KEY_ID", "abc") == "***"


def test_default_config_path_follows_accelerate():
    assert accelerate_default_config_path({"HF_HOME": "/x"}) == Path("/x/accelerate/default_config.yaml")
    xdg = accelerate_default_config_path({"XDG_CACHE_HOME": "/c"})
    assert xdg == Path("/c/huggingface/accelerate/default_config.yaml")
    assert accelerate_default_config_path({}) == Path("~/.cache/huggingface/accelerate/default_config.yaml").expanduser()


@pytest.mark.slow
def test_a_broken_default_config_is_reported_not_fatal(tmp_path):
    broken = "distributed_type: FSDP\nfsdp_config:\n  fsdp_bogus_key: 1\nmixed_precision: bf17\n"
    out = overdrive_env(shell(tmp_path, default_config=broken), "--no-hardware")
    assert "fsdp_bogus_key: 1" in out  # shown as written: a key named *_key is no secret
    assert "### Problems" in out and "bf17" in out and "fsdp_bogus_key" in out.split("### Problems")[1]
