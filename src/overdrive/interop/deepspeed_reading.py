"""DeepSpeed JSON mapped into the schema.

Explicit values become settings marked native="deepspeed" (a different winning value from a
higher layer is then a contradiction, reported by validation), `"auto"` values are left to be
filled from the run config, and entries with no schema key go to parallel.deepspeed.extra
verbatim, so the user's file is accepted as it is.
"""

from __future__ import annotations

from typing import Any, Mapping

from overdrive.interop.tables import DEEPSPEED_CONFIG_KEYS


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def map_deepspeed(data: Mapping[str, Any], c) -> None:
    """A DeepSpeed JSON: explicit values become settings marked native="deepspeed" (so a
    different winning value is reported as a contradiction), `"auto"` values are left to be
    filled from the run config, everything else goes to parallel.deepspeed.extra verbatim."""
    extra_prefix = "parallel.deepspeed.extra"
    precision_on = [name for name in ("fp16", "bf16", "bfloat16")
                    if isinstance(data.get(name), Mapping) and data[name].get("enabled") is True]
    if "fp16" in precision_on and len(precision_on) > 1:
        c.error((precision_on[1], "enabled"), "fp16 and bf16 are both enabled", "enable one of them (or set both to \"auto\")")
    for key, value in data.items():
        path = (key,)
        if key in ("fp16", "bf16", "bfloat16") and isinstance(value, Mapping):
            _map_ds_precision(key, value, c)
        elif key == "zero_optimization" and isinstance(value, Mapping):
            _map_zero(value, c)
        elif key == "optimizer" and isinstance(value, Mapping):
            _map_ds_optimizer(value, c)
        elif key == "scheduler" and isinstance(value, Mapping):
            _map_ds_scheduler(value, c)
        elif key in DEEPSPEED_CONFIG_KEYS:
            if not _is_auto(value):
                target = DEEPSPEED_CONFIG_KEYS[key]
                if key == "gradient_clipping" and not value:
                    value = None  # DeepSpeed's 0.0 means no clipping
                c.set(target, value, *path)
        elif key == "expert_parallel" and isinstance(value, Mapping):
            _map_ds_expert_parallel(value, c)
        elif key == "activation_checkpointing":
            c.set("parallel.deepspeed.activation_checkpointing", True, *path)
            c.set(f"{extra_prefix}.{key}", value, *path)
        else:
            c.set(f"{extra_prefix}.{key}", value, *path)


def _map_ds_expert_parallel(section: Mapping[str, Any], c) -> None:
    """DeepSpeed's `expert_parallel` (AutoEP): its own MoE layers put in place of the model's and split
    over `autoep_size` ranks. Switched on, it is refused by key (expert parallel here is Transformers'
    plan beside DDP, parallel.ep_size); switched off, it asks for nothing."""
    if section.get("enabled") is not True:
        return
    size = section.get("autoep_size", 1)
    c.error(("expert_parallel", "enabled"), "DeepSpeed's AutoEP (its own MoE layers in place of the model's) is not "
            "run: expert parallel here is Transformers' plan beside DDP",
            f"remove the expert_parallel section; set parallel.strategy=ddp parallel.ep_size={size}"
            + (" (and model.moe.top_k / model.moe.aux_loss_coef for its top_k / load_balance_coeff)"
               if "top_k" in section or "load_balance_coeff" in section else ""))


def _map_ds_precision(key: str, section: Mapping[str, Any], c) -> None:
    enabled = section.get("enabled")
    if key == "bfloat16":
        c.warn((key,), "legacy section name; DeepSpeed now calls it `bf16`", "rename it to bf16")
    if enabled is True:
        c.set("precision.mixed_precision", "fp16" if key == "fp16" else "bf16", key, "enabled")
    for name, value in section.items():
        if name == "enabled":
            continue
        if key == "fp16" and name in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            c.set(f"parallel.deepspeed.{name}", value, key, name)
        else:
            c.set(f"parallel.deepspeed.extra.{'bf16' if key == 'bfloat16' else key}.{name}", value, key, name)


def _map_zero(zero: Mapping[str, Any], c) -> None:
    for name, value in zero.items():
        path = ("zero_optimization", name)
        if name in ("offload_optimizer", "offload_param") and isinstance(value, Mapping):
            device = str(value.get("device", "none")).lower()
            c.set(f"parallel.deepspeed.{name}", device, *path, "device") if "device" in value else None
            if value.get("nvme_path"):
                c.set("parallel.deepspeed.nvme_path", value["nvme_path"], *path, "nvme_path")
            if "pin_memory" in value:
                c.set("parallel.deepspeed.offload_pin_memory", value["pin_memory"], *path, "pin_memory")
            for other, other_value in value.items():
                if other not in ("device", "nvme_path", "pin_memory"):
                    c.set(f"parallel.deepspeed.extra.zero_optimization.{name}.{other}", other_value, *path, other)
        elif name == "stage":
            c.set("parallel.deepspeed.zero_stage", value, *path)
        elif name in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
            if not _is_auto(value):
                c.set("parallel.deepspeed.zero3_save_16bit_model", value, *path)
        elif name in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
                      "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                      "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size"):
            c.set(f"parallel.deepspeed.{name}", value, *path)
        else:
            c.set(f"parallel.deepspeed.extra.zero_optimization.{name}", value, *path)


def _map_ds_optimizer(section: Mapping[str, Any], c) -> None:
    """Adam and AdamW become overdrive's own optimizer (optim.*); any other type (Lamb,
    OneBitAdam, Adagrad, Lion, ...) is handed to DeepSpeed as it is: `optim.name=deepspeed`
    and the block under parallel.deepspeed.extra.optimizer, each value with its line. Its lr,
    betas, eps and weight_decay still become optim.* (the schedule and the reports read them)."""
    kind = str(section.get("type", "AdamW"))
    if kind.lower() not in ("adamw", "adam"):
        c.set("optim.name", "deepspeed", "optimizer", "type")
        c.set("parallel.deepspeed.extra.optimizer.type", kind, "optimizer", "type")
    for name, value in section.items():
        if name not in ("type", "params"):
            c.set(f"parallel.deepspeed.extra.optimizer.{name}", value, "optimizer", name)
    for name, value in (section.get("params") or {}).items():
        if _is_auto(value):
            continue
        target = {"lr": "optim.lr", "betas": "optim.betas", "eps": "optim.eps", "weight_decay": "optim.weight_decay"}.get(name)
        if target:
            c.set(target, tuple(value) if name == "betas" else value, "optimizer", "params", name)
            if kind.lower() not in ("adamw", "adam"):  # handed over: the block keeps the name, filled from optim.*
                c.set(f"parallel.deepspeed.extra.optimizer.params.{name}", "auto", "optimizer", "params", name)
        else:
            c.set(f"parallel.deepspeed.extra.optimizer.params.{name}", value, "optimizer", "params", name)


def _map_ds_scheduler(section: Mapping[str, Any], c) -> None:
    kind = str(section.get("type", ""))
    names = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
    if kind not in names:
        c.error(("scheduler", "type"), f"{kind!r} is not supported", f"one of: {', '.join(names)}")
        return
    c.set("scheduler.name", names[kind], "scheduler", "type")
    for name, value in (section.get("params") or {}).items():
        if _is_auto(value):
            continue
        target = {"warmup_num_steps": "scheduler.warmup_steps", "warmup_max_lr": "optim.lr",
                  "total_num_steps": "training.max_steps", "cos_min_ratio": "scheduler.min_lr_ratio"}.get(name)
        if target:
            c.set(target, value, "scheduler", "params", name)
        elif name == "warmup_min_lr" and not value:
            continue  # overdrive's warmup starts from 0, as DeepSpeed's default
        else:
            c.set(f"parallel.deepspeed.extra.scheduler.params.{name}", value, "scheduler", "params", name)
