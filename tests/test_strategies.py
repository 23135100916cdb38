"""Run config -> Accelerator arguments: pure functions, no process group."""

from __future__ import annotations

import json

import pytest
from conftest import cfg_of
from conftest import PEER_CONFIGS

from overdrive.config import RunConfig
from overdrive.resolving import resolve
from overdrive.errors import Problem, UserError
from overdrive.strategies import accelerator_kwargs, deepspeed, fsdp, problems
from overdrive.strategies import deepspeed_config

TRANSFORMERS_DS = PEER_CONFIGS / "transformers" / "tests" / "deepspeed"
TOY = ["model.architecture.n_embd=32", "model.architecture.n_head=2", "model.architecture.n_layer=2"]


def leaves(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# --------------------------------------------------------------------------- DDP and common


def test_ddp_kwargs_are_explicit():
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs, TorchDynamoPlugin

    kwargs = accelerator_kwargs(cfg_of("precision.mixed_precision=bf16", "training.gradient_accumulation_steps=4",
                                       "parallel.ddp.bucket_cap_mb=50", "launch.use_cpu=true"), 2)
    assert kwargs["mixed_precision"] == "bf16"
    plugin = kwargs["gradient_accumulation_plugin"]
    # The step ends after its micro-batches, never at the loader's end (the loop draws a step ahead).
    assert plugin.num_steps == 4 and plugin.sync_with_dataloader is False
    assert kwargs["cpu"] is True
    assert isinstance(kwargs["dynamo_plugin"], TorchDynamoPlugin)
    handlers = {type(h): h for h in kwargs["kwargs_handlers"]}
    assert handlers[DistributedDataParallelKwargs].bucket_cap_mb == 50
    assert handlers[InitProcessGroupKwargs].backend == "gloo"  # CPU: gloo, named explicitly


def test_a_lone_ddp_process_names_no_backend():
    from accelerate.utils import InitProcessGroupKwargs

    kwargs = accelerator_kwargs(cfg_of("launch.use_cpu=true"), 1)
    assert not any(isinstance(h, InitProcessGroupKwargs) for h in kwargs["kwargs_handlers"])


def test_compile_settings_reach_the_dynamo_plugin(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "true")
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    plugin = accelerator_kwargs(cfg_of("compile.backend=aot_eager", "compile.mode=reduce-overhead"), 1)["dynamo_plugin"]
    assert plugin.backend.value == "AOT_EAGER"
    assert plugin.mode == "reduce-overhead"
    assert plugin.dynamic is None  # "torch decides", as configured; not the variable
    assert accelerator_kwargs(cfg_of(), 1)["dynamo_plugin"].backend.value == "NO"


# --------------------------------------------------------------------------- DeepSpeed


def test_deepspeed_dict_is_complete_and_filled_from_the_run_config():
    cfg = cfg_of(*TOY, "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3",
                 "training.micro_batch_size=4", "training.gradient_accumulation_steps=3",
                 "training.gradient_clipping=0.5", "precision.mixed_precision=bf16",
                 "parallel.deepspeed.offload_optimizer=nvme", "parallel.deepspeed.offload_param=cpu",
                 "parallel.deepspeed.nvme_path=/scratch/nvme", "parallel.deepspeed.extra.steps_per_print=7")
    ds = deepspeed_config.ds_config(cfg, world_size=2)
    assert "auto" not in [value for _, value in leaves(ds)]
    assert ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 3 * 2
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True} and ds["fp16"]["enabled"] is False
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/scratch/nvme"}
    assert zero["offload_param"]["device"] == "cpu"
    # As the Transformers integration: from the hidden size h = 32.
    assert zero["reduce_bucket_size"] == 32 * 32
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
    assert zero["stage3_param_persistence_threshold"] == 10 * 32
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert ds["steps_per_print"] == 7  # extra, verbatim
    assert "optimizer" not in ds and "scheduler" not in ds  # overdrive passes its own AdamW


def test_unknown_hidden_size_leaves_bucket_autos_for_prepare():
    cfg = cfg_of("parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3")
    ds = deepspeed_config.fill_auto(deepspeed_config.template(cfg), cfg, 1, hidden_size=None)
    assert ds["zero_optimization"]["reduce_bucket_size"] == "auto"
    assert ds["train_micro_batch_size_per_gpu"] == cfg.training.micro_batch_size


@pytest.mark.parametrize("name", ["ds_config_zero2.json", "ds_config_zero3_bf16.json"])
def test_fill_auto_fills_every_auto_of_the_transformers_configs(name):
    raw = json.loads((TRANSFORMERS_DS / name).read_text())
    cfg = resolve([TRANSFORMERS_DS / name], cli=["training.micro_batch_size=4", *TOY], env={},
                  accelerate_default=False).config
    filled = deepspeed_config.fill_auto(raw, cfg, world_size=2, hidden_size=32)
    assert [key for key, value in leaves(filled) if value == "auto"] == []
    assert filled["train_batch_size"] == 4 * 1 * 2
    assert filled["optimizer"]["params"]["lr"] == cfg.optim.lr
    assert filled["optimizer"]["params"]["betas"] == list(cfg.optim.betas)
    assert filled["scheduler"]["params"]["warmup_num_steps"] == cfg.scheduler.warmup_steps
    assert filled["scheduler"]["params"]["warmup_max_lr"] == cfg.optim.lr
    assert "bfloat16" not in filled and "bf16" in filled  # legacy name normalised
    assert filled["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_fill_auto_reports_contradictions_naming_the_key():
    cfg = cfg_of("parallel.strategy=deepspeed", "training.micro_batch_size=4", "training.gradient_accumulation_steps=2")
    user = {"train_batch_size": 99, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2}}
    found: list[Problem] = []
    deepspeed_config.fill_auto(user, cfg, world_size=2, hidden_size=32, problems=found)
    keys = {p.key for p in found}
    assert "training.micro_batch_size" in keys  # train_batch_size 99 != 4 x 2 x 2
    assert "precision.mixed_precision" in keys  # bf16 enabled, but precision is "no"
    assert any("16" in p.message and "99" in p.message for p in found)
    with pytest.raises(UserError) as raised:
        deepspeed_config.fill_auto(user, cfg, world_size=2, hidden_size=32)
    assert "training.micro_batch_size" in str(raised.value)


def test_extra_contradicting_the_schema_is_refused_before_launch():
    items = ["parallel.strategy=deepspeed", "parallel.deepspeed.extra.gradient_accumulation_steps=8"]
    # Validation already refuses it when the config is resolved, naming the key...
    with pytest.raises(UserError, match="training.gradient_accumulation_steps"):
        cfg_of(*items)
    # ...and so does the strategy's own check for a config built without validation.
    cfg = RunConfig.model_validate({"parallel": {"strategy": "deepspeed", "deepspeed": {"extra": {"gradient_accumulation_steps": 8}}}})
    assert [p.key for p in problems(cfg, 2)] == ["training.gradient_accumulation_steps"]


def test_deepspeed_plugin_ignores_accelerate_variables(monkeypatch):
    for name, value in {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "1", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "9",
                        "ACCELERATE_GRADIENT_CLIPPING": "3.0", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "nvme",
                        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}.items():
        monkeypatch.setenv(name, value)
    cfg = cfg_of(*TOY, "parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3",
                 "training.gradient_accumulation_steps=2", "training.gradient_clipping=0.5")
    plugin = deepspeed.plugin(cfg, 2)
    assert plugin.zero_stage == 3
    assert plugin.gradient_accumulation_steps == 2
    assert plugin.gradient_clipping == 0.5
    assert plugin.offload_optimizer_device == "none"
    assert plugin.zero3_init_flag is False
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 3
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 2


# --------------------------------------------------------------------------- FSDP2


def test_fsdp2_plugin_from_config_not_from_variables(monkeypatch):
    from torch.distributed.fsdp import StateDictType

    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Linear")
    monkeypatch.setenv("FSDP_IGNORED_MODULES", "lm_head")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    cfg = cfg_of("parallel.strategy=fsdp", "parallel.fsdp.reshard_after_forward=false",
                 "parallel.fsdp.offload_params=true", "parallel.fsdp.activation_checkpointing=true")
    plugin = fsdp.plugin(cfg)
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is False
    assert plugin.activation_checkpointing is True
    assert type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy"
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    # Empty means the model's own _no_split_modules (read by Accelerate at prepare time).
    assert plugin.transformer_cls_names_to_wrap is None
    assert plugin.ignored_modules is None


def test_fsdp_layers_to_wrap_by_name_and_from_no_split_modules():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    default = fsdp.plugin(cfg_of("parallel.strategy=fsdp"))
    default.set_auto_wrap_policy(model)
    assert default.transformer_cls_names_to_wrap == ["GPT2Block"]
    named = fsdp.plugin(cfg_of("parallel.strategy=fsdp", "parallel.fsdp.transformer_layer_cls_to_wrap=[GPT2MLP]"))
    assert named.transformer_cls_names_to_wrap == ["GPT2MLP"]


def test_fsdp_state_dict_and_mixed_precision():
    import torch
    from torch.distributed.fsdp import StateDictType

    plugin = fsdp.plugin(cfg_of("parallel.strategy=fsdp", "parallel.fsdp.state_dict_type=full_state_dict"))
    assert plugin.state_dict_type == StateDictType.FULL_STATE_DICT
    plugin.set_mixed_precision("bf16")
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16


# --------------------------------------------------------------------------- what cannot run here


def test_cpu_refusals_name_the_key():
    keys = {p.key for p in problems(cfg_of("parallel.strategy=fsdp", "parallel.fsdp.version=1"), gpus=0)}
    assert keys == {"parallel.fsdp.version"}
    keys = {p.key for p in problems(cfg_of("parallel.strategy=deepspeed", "precision.mixed_precision=fp16"), gpus=0)}
    assert keys == {"precision.mixed_precision"}
