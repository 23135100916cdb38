"""Validation: every problem at once, each naming the key, where it was set, and the fix."""

from __future__ import annotations

import json

import pytest

from conftest import PEER_CONFIGS, problems_of, run_cli
from overdrive.resolving import check_for_train, hardware_warnings, resolve
from overdrive.errors import UserError
from overdrive.system.hardware import Gpu, Hardware


@pytest.mark.slow
def test_misspelled_nested_key_exits_2_with_line_and_suggestion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("parallel:\n  deepspeed:\n    zero_stag: 3\n")
    result = run_cli("explain", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert f"{path}:3" in result.stderr
    assert "did you mean `parallel.deepspeed.zero_stage`?" in result.stderr


@pytest.mark.slow
def test_five_mistakes_are_reported_in_one_run(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "optim:\n  lr: -1\n"                      # 1: range
        "training:\n  micro_batch_size: lots\n"   # 2: type
        "  gradient_acumulation_steps: 2\n"        # 3: unknown key
        "precision:\n  mixed_precision: fp32\n"   # 4: not a choice
        "launch:\n  num_processes: 3\n  num_machines: 2\n  main_process_ip: 10.0.0.1\n"  # 5: uneven
    )
    result = run_cli("explain", str(path))
    assert result.returncode == 2
    assert "5 problems" in result.stderr, result.stderr
    for key, line in [("optim.lr", 2), ("training.micro_batch_size", 4), ("training.gradient_acumulation_steps", 5),
                      ("precision.mixed_precision", 7), ("launch.num_processes", 9)]:
        assert f"{key}:" in result.stderr and f"{path}:{line}" in result.stderr, key


def test_deepspeed_explicit_values_that_contradict_the_run_config(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                              "gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}, indent=2))
    text = problems_of("accum=8", "mbs=2", "clip=0.5", files=(ds,))
    for key in ("training.gradient_accumulation_steps", "training.micro_batch_size", "training.gradient_clipping"):
        assert key in text
    assert f"{ds}:3" in text and '"auto"' in text  # names the JSON line and the fix


def test_train_batch_size_must_be_micro_times_accum_times_world(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1}}))
    text = problems_of("mbs=8", "accum=2", "launch.num_processes=2", files=(ds,))
    assert "parallel.deepspeed.train_batch_size: is 64, but micro-batch 8 x accumulation 2 x world size 2 = 32" in text
    assert resolve([ds], cli=["mbs=8", "accum=4", "launch.num_processes=2"], env={}).config.parallel.deepspeed.train_batch_size == 64


def test_fp16_and_bf16_both_enabled(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"fp16": {"enabled": True}, "bf16": {"enabled": True}}))
    assert "fp16 and bf16 are both enabled" in problems_of(files=(ds,))


def test_strategy_rules():
    assert "needs ZeRO-3" in problems_of("strategy=deepspeed", "zero=2", "parallel.deepspeed.offload_param=cpu")
    assert "nvme offload needs a directory" in problems_of("strategy=deepspeed", "parallel.deepspeed.offload_optimizer=nvme")
    both = problems_of(env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_FSDP": "true"})
    assert "FSDP and DeepSpeed are both chosen" in both


def test_world_size_rules():
    assert "do not divide evenly over 2 machines" in problems_of("launch.num_processes=3", "launch.num_machines=2", "launch.main_process_ip=10.1.1.1")
    assert "ranks go 0..1" in problems_of("launch.num_machines=2", "launch.num_processes=2",
                                                "launch.machine_rank=2", "launch.main_process_ip=10.1.1.1")
    text = problems_of("launch.num_machines=2", "launch.num_processes=2")
    assert "launch.main_process_ip: is required with several machines" in text


def test_settings_for_an_unchosen_strategy_are_a_warning(tmp_path):
    hf = tmp_path / "hf" / "accelerate"
    hf.mkdir(parents=True)
    (hf / "default_config.yaml").write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_offload_params: true\n")
    resolved = resolve([], cli=["strategy=ddp"], env={"HF_HOME": str(tmp_path / "hf")})
    messages = [w.render() for w in resolved.warnings]
    assert any("Accelerate's default config" in m and "parallel.strategy" in m for m in messages)
    assert any("has no effect: parallel.strategy is ddp" in m for m in messages)


NO_GPU = Hardware(gpus=(), cpu_cores=2, ram_bytes=24 * 2**30)
V100 = Hardware(gpus=(Gpu("Tesla V100", 16 * 2**30, (7, 0)),) * 2, cpu_cores=16, ram_bytes=64 * 2**30)


def test_missing_hardware_is_a_warning_to_explain_and_an_error_to_train():
    resolved = resolve([PEER_CONFIGS / "accelerate/tests/test_configs/0_34_0_fp8.yaml"], env={})
    warnings = hardware_warnings(resolved, NO_GPU)
    assert warnings and "fp8 needs a GPU" in warnings[0].message and "detected: no GPU" in warnings[0].fix
    with pytest.raises(UserError, match="fp8 needs a GPU"):
        check_for_train(resolved, NO_GPU)
    bf16 = resolve([], cli=["precision=bf16", "launch.num_processes=2"], env={})
    check_for_train(bf16, NO_GPU)  # bf16 autocast runs on CPUs
    with pytest.raises(UserError, match="bf16 needs compute capability 8.0"):
        check_for_train(bf16, V100)
    with pytest.raises(UserError, match="4 processes per machine but 2 GPU"):
        check_for_train(resolve([], cli=["launch.num_processes=4"], env={}), V100)


@pytest.mark.slow
def test_explain_prints_hardware_warnings_and_exits_0():
    path = PEER_CONFIGS / "accelerate/examples/config_yaml_templates/fp8.yaml"
    result = run_cli("explain", str(path))
    assert result.returncode == 0
    assert "fp8 needs a GPU" in result.stderr


@pytest.mark.slow
def test_secrets_are_never_printed(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("parallel:\n  deepspeed:\n    extra:\n      hub_token: hf_SECRET123\n")
    result = run_cli("explain", str(path))
    assert result.returncode == 0 and "hf_SECRET123" not in result.stdout + result.stderr
    result = run_cli("explain", str(path), "--json")
    assert "hf_SECRET123" not in result.stdout
    assert json.loads(result.stdout)["config"]["parallel"]["deepspeed"]["extra"]["hub_token"] == "***"
