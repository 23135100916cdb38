"""Accelerate and DeepSpeed files, read as they are: every peer config loads or is refused clearly."""

from __future__ import annotations

import json

import pytest

from conftest import NO_SHARED_PEER_CONFIGS, PEER_CONFIGS, SHARED_PEER_CONFIGS, peer_files, run_cli
from overdrive.resolving import resolve
from overdrive.config.schema import RunConfig
from overdrive.errors import UserError

REFUSED = {
    "0_30_0_sagemaker.yaml": "debug: is written twice",  # lines 2 and 5: refused before its SageMaker keys
    "0_28_0_mpi.yaml": "mpirun_config.mpirun_hostfile",
    "invalid_keys.yaml": "invalid_key",
}
ALL_PEER_FILES = peer_files(PEER_CONFIGS)
SHARED_FILES = peer_files(SHARED_PEER_CONFIGS)


def test_peer_configs_are_present():
    assert len(ALL_PEER_FILES) >= 30


@pytest.mark.parametrize("path", ALL_PEER_FILES, ids=lambda p: str(p.relative_to(PEER_CONFIGS)))
def test_every_peer_config_loads_or_is_refused_naming_the_key(path):
    loads_or_is_refused(path)


@pytest.mark.skipif(not SHARED_FILES, reason=NO_SHARED_PEER_CONFIGS)
def test_every_shared_peer_config_loads_or_is_refused_naming_the_key():
    for path in SHARED_FILES:
        loads_or_is_refused(path)


def loads_or_is_refused(path):
    if path.name in REFUSED:
        with pytest.raises(UserError) as error:
            resolve([path], env={})
        assert REFUSED[path.name] in error.value.render() and str(path) in error.value.render()
    else:
        resolved = resolve([path], env={})
        assert any(origin.source.startswith(str(path.parent.parent)) for origin in resolved.origins.values())


@pytest.mark.slow
def test_invalid_keys_names_both_keys_with_lines():
    path = PEER_CONFIGS / "accelerate/tests/test_configs/invalid_keys.yaml"
    result = run_cli("explain", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"invalid_key: not an Accelerate config key  [{path}:14]" in result.stderr
    assert f"another_invalid_key: not an Accelerate config key  [{path}:15]" in result.stderr


@pytest.mark.slow
def test_explain_shows_fsdp_settings_with_file_and_line():
    path = PEER_CONFIGS / "accelerate/tests/test_configs/latest_fsdp.yaml"
    result = run_cli("explain", str(path))
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("parallel.")}
    assert "fsdp" in rows["parallel.strategy"] and f"{path}:3" in rows["parallel.strategy"]
    assert "['BertLayer']" in rows["parallel.fsdp.transformer_layer_cls_to_wrap"].replace('"', "'")
    assert f"{path}:17" in rows["parallel.fsdp.transformer_layer_cls_to_wrap"]
    assert "sharded_state_dict" in rows["parallel.fsdp.state_dict_type"] and f"{path}:15" in rows["parallel.fsdp.state_dict_type"]
    assert f"{path}:14" in rows["parallel.fsdp.reshard_after_forward"]  # FULL_SHARD -> reshard after forward
    assert "no fsdp_version" in result.stderr  # Accelerate would run FSDP1 here: said out loud


def test_legacy_accelerate_forms(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: NO\nfp16: true\n"
                    "dynamo_backend: INDUCTOR\nnum_processes: 1\nuse_cpu: false\n")
    cfg = resolve([path], env={}).config
    assert cfg.parallel.strategy == "ddp"  # bare NO is YAML 1.1 false
    assert cfg.precision.mixed_precision == "fp16"
    assert cfg.compile.backend == "inductor"


def test_dynamo_config_and_fp8_tuple_string():
    cfg = resolve([PEER_CONFIGS / "accelerate/tests/test_configs/0_34_0_fp8.yaml"], env={}).config
    assert cfg.precision.mixed_precision == "fp8"
    assert cfg.precision.fp8.override_linear_precision == (False, False, False)
    assert cfg.launch.num_processes == 2


def test_deepspeed_json_autos_and_legacy_sections():
    zero3 = resolve([PEER_CONFIGS / "transformers/tests/deepspeed/ds_config_zero3_bf16.json"], env={})
    ds = zero3.config.parallel.deepspeed
    assert zero3.config.parallel.strategy == "deepspeed" and ds.zero_stage == 3
    assert ds.offload_optimizer == "cpu" and ds.offload_param == "cpu"
    assert ds.reduce_bucket_size == "auto"  # left for the run config to fill
    # "auto": the run config's own value, here the default
    assert zero3.config.training.micro_batch_size == RunConfig().training.micro_batch_size
    assert any("legacy section name" in w.message for w in zero3.warnings)
    old = resolve([PEER_CONFIGS / "transformers/tests/deepspeed/ds_config_zero3.json"], env={})
    assert old.config.parallel.deepspeed.zero3_save_16bit_model is True  # stage3_gather_fp16_weights_on_model_save
    assert old.config.optim.betas == (0.8, 0.999) and old.config.precision.mixed_precision == "fp16"
    assert old.config.parallel.deepspeed.sub_group_size == 10**14
    assert old.config.parallel.deepspeed.extra["steps_per_print"] == 2000


def test_accelerate_yaml_follows_its_deepspeed_config_file():
    path = PEER_CONFIGS / "accelerate/examples/config_yaml_templates/deepspeed.yaml"
    resolved = resolve([path], env={})
    assert resolved.config.parallel.deepspeed.zero_stage == 1
    assert resolved.origins["parallel.deepspeed.zero_stage"].source.endswith("zero_stage1_config.json")
    assert resolved.origins["launch.num_processes"].source == str(path)


def test_inline_values_conflicting_with_deepspeed_config_file(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}))
    acc = tmp_path / "acc.yaml"
    acc.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
                   "  zero_stage: 3\n  gradient_accumulation_steps: 4\n")
    with pytest.raises(UserError) as error:
        resolve([acc], env={})
    text = error.value.render()
    assert "deepspeed_config.zero_stage: 3 conflicts with 2" in text and f"{acc}:4" in text
    assert "gradient_accumulation_steps" not in text  # agreeing values are fine


def test_accelerate_environment_variables():
    env = {"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
           "FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block,Block",
           "ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_USE_CPU": "true"}
    resolved = resolve([], env=env)
    cfg = resolved.config
    assert cfg.precision.mixed_precision == "bf16" and cfg.parallel.strategy == "fsdp"
    assert cfg.parallel.fsdp.reshard_after_forward is False
    assert cfg.parallel.fsdp.transformer_layer_cls_to_wrap == ["GPT2Block", "Block"]
    assert cfg.compile.backend == "inductor" and cfg.launch.use_cpu is True
    assert str(resolved.origins["parallel.fsdp.reshard_after_forward"]) == "env FSDP_SHARDING_STRATEGY"
    env_ds = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
              "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "cpu", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "8"}
    cfg = resolve([], env=env_ds).config
    assert (cfg.parallel.strategy, cfg.parallel.deepspeed.zero_stage, cfg.parallel.deepspeed.offload_param) == ("deepspeed", 3, "cpu")
    assert cfg.training.gradient_accumulation_steps == 8


def test_sections_accelerate_would_drop_are_reported():
    path = PEER_CONFIGS / "accelerate/tests/test_configs/validate_launch_cmd.yaml"
    resolved = resolve([path], env={})
    dropped = {w.key for w in resolved.warnings}
    assert {"deepspeed_config", "fsdp_config"} <= dropped
