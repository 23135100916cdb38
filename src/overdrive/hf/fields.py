"""Which TrainingArguments field each overdrive key becomes: one table, read by three users.

`training_arguments(cfg)` builds a TrainingArguments from it, `overdrive explain
--training-arguments` prints it, and `overdrive launch` applies the fields the config sets
to an unchanged script's own TrainingArguments (launch/script_values.py). Pure: imports
neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from overdrive.config.schema import RunConfig

# A value the config cannot give (the micro-batch is `auto`, measured only by `overdrive train`).
UNKNOWN = object()
# Overdrive's schedule names as Transformers' SchedulerType; cosine decays to
# `scheduler.min_lr_ratio` x lr, which Transformers spells cosine_with_min_lr + min_lr_rate.
SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine_with_min_lr",
             "wsd": "warmup_stable_decay", "polynomial": "polynomial", "inverse_sqrt": "inverse_sqrt",
             "cosine_with_restarts": "cosine_with_restarts"}
# optim.name -> TrainingArguments.optim, where the Trainer builds the same optimizer (its Adafactor
# and Lion are other implementations; Muon and the rest have no Trainer name): the rest stay unset.
OPTIMIZERS = {"sgd": "sgd", "schedule_free_adamw": "schedule_free_adamw", "adamw_8bit": "adamw_bnb_8bit"}


@dataclass(frozen=True)
class Field:
    name: str  # the TrainingArguments field
    key: str  # the overdrive key it comes from
    value: Callable[[RunConfig], Any]
    # False: only `training_arguments(cfg)` sets it. The strategy reaches a launched script
    # through Accelerate's environment instead, as with `accelerate launch`.
    launch: bool = True


def _schedule_kwargs(cfg: RunConfig) -> dict:
    s = cfg.scheduler
    if s.name == "cosine":
        return {"min_lr_rate": s.min_lr_ratio}
    if s.name == "wsd":
        decay = max(1, round(s.decay_fraction * max(0, cfg.training.max_steps - s.warmup_steps)))
        return {"num_decay_steps": decay, "decay_type": s.decay_type, "min_lr_ratio": s.min_lr_ratio}
    if s.name == "polynomial":
        return {"lr_end": cfg.optim.lr * min(s.min_lr_ratio, 1 - 1e-12), "power": s.power}
    if s.name == "cosine_with_restarts":
        return {"num_cycles": s.num_cycles}
    return {}


def _micro(cfg: RunConfig) -> Any:
    micro = cfg.training.micro_batch_size
    return UNKNOWN if micro == "auto" else micro


def _save_steps(cfg: RunConfig) -> int:
    return cfg.checkpoint.every_steps or cfg.training.max_steps


def _use_cpu(cfg: RunConfig) -> bool:
    from overdrive.strategies import cpu

    return cpu.construct_with_cpu_flag(cfg)


def _deepspeed(cfg: RunConfig) -> Any:
    from overdrive.interop.writing import deepspeed_json, distributed_type

    if distributed_type(cfg) != "DEEPSPEED":
        return None
    return deepspeed_json(cfg, trainer_owned_auto=True)


def _fsdp(cfg: RunConfig) -> Any:
    from overdrive.interop.writing import distributed_type

    if distributed_type(cfg) != "FSDP":
        return ""
    return "full_shard auto_wrap" + (" offload" if cfg.parallel.fsdp.offload_params else "")


def _fsdp_config(cfg: RunConfig) -> Any:
    from overdrive.interop.writing import distributed_type

    if distributed_type(cfg) != "FSDP":
        return None
    f = cfg.parallel.fsdp
    section: dict[str, Any] = {
        "version": f.version, "reshard_after_forward": f.reshard_after_forward,
        "auto_wrap_policy": f.auto_wrap_policy.upper(), "min_num_params": f.min_num_params,
        "state_dict_type": f.state_dict_type.upper(), "activation_checkpointing": f.activation_checkpointing,
        "cpu_ram_efficient_loading": f.cpu_ram_efficient_loading,
    }
    if f.transformer_layer_cls_to_wrap:
        section["transformer_layer_cls_to_wrap"] = list(f.transformer_layer_cls_to_wrap)
    return section


FIELDS: tuple[Field, ...] = (
    Field("output_dir", "output_dir", lambda c: c.output_dir),
    Field("per_device_train_batch_size", "training.micro_batch_size", _micro),
    Field("per_device_eval_batch_size", "training.micro_batch_size", _micro),
    Field("gradient_accumulation_steps", "training.gradient_accumulation_steps", lambda c: c.training.gradient_accumulation_steps),
    Field("max_steps", "training.max_steps", lambda c: c.training.max_steps),
    # No clipping is 0.0 for both the Trainer and DeepSpeed.
    Field("max_grad_norm", "training.gradient_clipping", lambda c: c.training.gradient_clipping or 0.0),
    Field("seed", "training.seed", lambda c: c.training.seed),
    Field("logging_steps", "training.log_every_steps", lambda c: c.training.log_every_steps),
    Field("learning_rate", "optim.lr", lambda c: c.optim.lr),
    Field("weight_decay", "optim.weight_decay", lambda c: c.optim.weight_decay),
    Field("adam_beta1", "optim.betas", lambda c: c.optim.betas[0]),
    Field("adam_beta2", "optim.betas", lambda c: c.optim.betas[1]),
    Field("adam_epsilon", "optim.eps", lambda c: c.optim.eps),
    Field("lr_scheduler_type", "scheduler.name", lambda c: SCHEDULES[c.scheduler.name]),
    Field("lr_scheduler_kwargs", "scheduler.min_lr_ratio", _schedule_kwargs),
    Field("optim", "optim.name", lambda c: OPTIMIZERS.get(c.optim.name, UNKNOWN) if not c.optim.class_path else UNKNOWN),
    Field("warmup_steps", "scheduler.warmup_steps", lambda c: c.scheduler.warmup_steps),
    Field("bf16", "precision.mixed_precision", lambda c: c.precision.mixed_precision == "bf16"),
    Field("fp16", "precision.mixed_precision", lambda c: c.precision.mixed_precision == "fp16"),
    Field("save_strategy", "checkpoint.enabled", lambda c: "steps" if c.checkpoint.enabled else "no"),
    Field("save_steps", "checkpoint.every_steps", _save_steps),
    Field("save_total_limit", "checkpoint.keep_last", lambda c: c.checkpoint.keep_last),
    Field("activation_checkpointing", "model.gradient_checkpointing", lambda c: c.model.gradient_checkpointing),
    Field("dataloader_num_workers", "data.num_workers", lambda c: c.data.num_workers),
    Field("use_cpu", "launch.use_cpu", _use_cpu, launch=False),
    Field("deepspeed", "parallel.deepspeed", _deepspeed, launch=False),
    Field("fsdp", "parallel.fsdp", _fsdp, launch=False),
    Field("fsdp_config", "parallel.fsdp", _fsdp_config, launch=False),
)


def values(cfg: RunConfig) -> list[tuple[Field, Any]]:
    """(field, value) for every field the config can give."""
    out = []
    for field in FIELDS:
        value = field.value(cfg)
        if value is not UNKNOWN:
            out.append((field, value))
    return out
