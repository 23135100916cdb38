"""The DeepSpeed config dict of a run, from the run config: one recipe for every consumer.

The dict is written from the run config as a template whose run-dependent entries are
`"auto"`, `parallel.deepspeed.extra` is merged over it verbatim, and `fill_auto` then fills
every `"auto"` from the run config, as the Transformers integration does, and reports any
explicit value that contradicts the run config instead of silently keeping either.

`ds_config(cfg, world_size)` is that recipe; the plugin (strategies/deepspeed.py), the
exported JSON (writing.py) and validation all call it. Pure dict work: imports neither
torch nor deepspeed.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Mapping, Optional

import overdrive.config.batch as batch
from overdrive.config.schema import RunConfig
from overdrive.errors import Problem, UserError

AUTO = "auto"
# Bucket sizes follow the model's hidden size h, as in transformers.integrations.deepspeed.
HIDDEN_RULES = {
    "zero_optimization.reduce_bucket_size": ("parallel.deepspeed.reduce_bucket_size", lambda h: h * h),
    "zero_optimization.stage3_prefetch_bucket_size": ("parallel.deepspeed.stage3_prefetch_bucket_size", lambda h: int(0.9 * h * h)),
    "zero_optimization.stage3_param_persistence_threshold": ("parallel.deepspeed.stage3_param_persistence_threshold", lambda h: 10 * h),
}
# Sections overdrive keeps on its side: its own optimizer and schedule are used (see module doc),
# except that the optimizer block is passed on when DeepSpeed builds the optimizer (optim.name=deepspeed).
CLIENT_SIDE_SECTIONS = ("optimizer", "scheduler")


def hidden_size_of(cfg: RunConfig) -> Optional[int]:
    """The model's hidden size from the inline architecture or the checkpoint's config.

    None when it cannot be known without downloading: the bucket entries then stay `"auto"`
    and Accelerate fills them from `model.config` at prepare time, with the same rule.
    """
    arch = cfg.model.architecture or {}
    if not cfg.model.name_or_path:
        for key in ("hidden_size", "n_embd", "d_model", "dim"):
            if isinstance(arch.get(key), int):
                return arch[key]
        return None
    try:
        from transformers import AutoConfig

        from overdrive import hub

        with hub.reading("model.name_or_path", cfg.model.name_or_path, revision=cfg.model.revision):
            config = AutoConfig.from_pretrained(cfg.model.name_or_path, revision=cfg.model.revision,
                                                trust_remote_code=cfg.model.trust_remote_code)
    except Exception:  # offline, private, or not a transformers model: leave it to prepare()
        return None
    config = config.get_text_config()  # a vision-language model's buckets by its language model's width
    sizes = getattr(config, "hidden_sizes", None)
    return getattr(config, "hidden_size", None) or (max(sizes) if sizes else None)


def _offload(device: str, ds) -> dict[str, Any]:
    section: dict[str, Any] = {"device": device, "pin_memory": ds.offload_pin_memory}
    if device == "nvme":
        section["nvme_path"] = ds.nvme_path
    return section


def template(cfg: RunConfig) -> dict[str, Any]:
    """The schema's DeepSpeed settings as a DeepSpeed dict, run-dependent values `"auto"`."""
    ds = cfg.parallel.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(ds.offload_optimizer, ds)
    if ds.offload_param != "none":
        zero["offload_param"] = _offload(ds.offload_param, ds)
    for name in ("overlap_comm", "contiguous_gradients", "allgather_bucket_size", "sub_group_size"):
        if getattr(ds, name) is not None:
            zero[name] = getattr(ds, name)
    zero["reduce_bucket_size"] = ds.reduce_bucket_size
    if ds.zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = ds.stage3_prefetch_bucket_size
        zero["stage3_param_persistence_threshold"] = ds.stage3_param_persistence_threshold
        for name in ("stage3_max_live_parameters", "stage3_max_reuse_distance"):
            if getattr(ds, name) is not None:
                zero[name] = getattr(ds, name)
        zero["stage3_gather_16bit_weights_on_model_save"] = ds.zero3_save_16bit_model
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": AUTO,
        "gradient_accumulation_steps": AUTO,
        "train_batch_size": AUTO,
        "gradient_clipping": AUTO,
        "fp16": {"enabled": AUTO, "loss_scale": ds.loss_scale, "initial_scale_power": ds.initial_scale_power,
                 "loss_scale_window": ds.loss_scale_window, "hysteresis": ds.hysteresis,
                 "min_loss_scale": ds.min_loss_scale},
        "bf16": {"enabled": AUTO},
        "zero_optimization": zero,
        # A client optimizer that is not DeepSpeed's own is "untested" to DeepSpeed.
        "zero_allow_untested_optimizer": True,
    }
    if ds.activation_checkpointing:
        config["activation_checkpointing"] = {"partition_activations": True, "contiguous_memory_optimization": False}
    return config


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            deep_merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def passed_on_extra(cfg: RunConfig) -> dict[str, Any]:
    """`parallel.deepspeed.extra` minus the sections overdrive keeps on its side: the optimizer
    block is passed on only when DeepSpeed builds the optimizer (`optim.name=deepspeed`), with
    the run config's lr, betas, eps and weight decay ("auto" filled as any other)."""
    extra = cfg.parallel.deepspeed.extra
    passed = {k: v for k, v in extra.items() if k not in CLIENT_SIDE_SECTIONS}
    if cfg.optim.name == "deepspeed" and isinstance(extra.get("optimizer"), Mapping):
        block = copy.deepcopy(dict(extra["optimizer"]))
        block["params"] = {"lr": AUTO, **(block.get("params") or {})}  # its own keys only: Adagrad has no betas
        passed["optimizer"] = block
    return passed


def ds_config(cfg: RunConfig, world_size: int, hidden_size: Optional[int] = None,
              problems: Optional[list[Problem]] = None, find_hidden_size: bool = True) -> dict[str, Any]:
    """The final DeepSpeed dict for this run: template, extra merged over it, "auto" filled.

    Contradictions raise UserError, or are appended to `problems` when a list is given.
    `find_hidden_size=False` leaves the bucket sizes "auto" when `hidden_size` is None
    (validation must not read a model's config from disk or the hub).
    """
    if hidden_size is None and find_hidden_size:
        hidden_size = hidden_size_of(cfg)
    merged = deep_merge(template(cfg), passed_on_extra(cfg))
    return fill_auto(merged, cfg, world_size, hidden_size, problems=problems)


# --------------------------------------------------------------------------- fill_auto


def _expected(cfg: RunConfig, world_size: int) -> dict[str, tuple[Any, str]]:
    """DeepSpeed key -> (value the run config implies, the overdrive key(s) that set it)."""
    t, o, s, ds = cfg.training, cfg.optim, cfg.scheduler, cfg.parallel.deepspeed
    mp = cfg.precision.mixed_precision
    micro = t.micro_batch_size
    values: dict[str, tuple[Any, str]] = {
        "gradient_accumulation_steps": (t.gradient_accumulation_steps, "training.gradient_accumulation_steps"),
        # DeepSpeed spells "no clipping" as 0.0.
        "gradient_clipping": (t.gradient_clipping or 0.0, "training.gradient_clipping"),
        "fp16.enabled": (mp == "fp16", "precision.mixed_precision"),
        # Accelerate trains fp8 under a bf16 autocast in DeepSpeed.
        "bf16.enabled": (mp in ("bf16", "fp8"), "precision.mixed_precision"),
        "zero_optimization.stage": (ds.zero_stage, "parallel.deepspeed.zero_stage"),
        "zero_optimization.offload_optimizer.device": (ds.offload_optimizer, "parallel.deepspeed.offload_optimizer"),
        "zero_optimization.offload_param.device": (ds.offload_param, "parallel.deepspeed.offload_param"),
        "zero_optimization.stage3_gather_16bit_weights_on_model_save": (ds.zero3_save_16bit_model, "parallel.deepspeed.zero3_save_16bit_model"),
        "optimizer.params.lr": (o.lr, "optim.lr"),
        "optimizer.params.betas": (list(o.betas), "optim.betas"),
        "optimizer.params.eps": (o.eps, "optim.eps"),
        "optimizer.params.weight_decay": (o.weight_decay, "optim.weight_decay"),
        "scheduler.params.warmup_min_lr": (0.0, "scheduler.warmup_steps (warmup starts from lr 0)"),
        "scheduler.params.warmup_max_lr": (o.lr, "optim.lr"),
        "scheduler.params.warmup_num_steps": (s.warmup_steps, "scheduler.warmup_steps"),
        "scheduler.params.total_num_steps": (t.max_steps, "training.max_steps"),
        "scheduler.params.cos_min_ratio": (s.min_lr_ratio, "scheduler.min_lr_ratio"),
    }
    if isinstance(micro, int):  # else (AUTO) Accelerate fills both from the DataLoader at prepare time
        values["train_micro_batch_size_per_gpu"] = (micro, "training.micro_batch_size")
        values["train_batch_size"] = (
            batch.of(micro, t.gradient_accumulation_steps, world_size).global_batch,
            f"training.micro_batch_size x training.gradient_accumulation_steps x world size "
            f"({micro} x {t.gradient_accumulation_steps} x {world_size})")
    return values


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return str(a).lower() == str(b).lower()
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _walk(node: dict[str, Any], prefix: str = ""):
    """(dotted key, parent dict, leaf key) for every leaf of a nested dict."""
    for key, value in list(node.items()):
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _walk(value, path + ".")
        else:
            yield path, node, key


def fill_auto(ds_config: Mapping[str, Any], cfg: RunConfig, world_size: int, hidden_size: Optional[int],
              problems: Optional[list[Problem]] = None) -> dict[str, Any]:
    """A copy of `ds_config` with every `"auto"` filled from the run config.

    An explicit value that contradicts the run config is a Problem naming the overdrive key
    to change. Pass a `problems` list to collect them (validation does); without one, any
    contradiction raises UserError. `"auto"` entries that cannot be known yet (micro-batch
    `"auto"`, bucket sizes of an unknown hidden size) are left for Accelerate's prepare().
    """
    config = copy.deepcopy(dict(ds_config))
    # DeepSpeed's legacy spellings, so each setting is checked under one name.
    if "bfloat16" in config and "bf16" not in config:
        config["bf16"] = config.pop("bfloat16")
    zero = config.get("zero_optimization")
    if isinstance(zero, dict) and "stage3_gather_fp16_weights_on_model_save" in zero:
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", zero.pop("stage3_gather_fp16_weights_on_model_save"))

    expected = _expected(cfg, world_size)
    found: list[Problem] = []
    for path, parent, key in _walk(config):
        value = parent[key]
        if path in HIDDEN_RULES:
            cfg_key, rule = HIDDEN_RULES[path]
            cfg_value = getattr(cfg.parallel.deepspeed, cfg_key.rsplit(".", 1)[1])
            target = cfg_value if cfg_value != AUTO else (rule(hidden_size) if hidden_size else None)
            if value == AUTO:
                if target is not None:
                    parent[key] = target
            elif cfg_value != AUTO and not _same(value, cfg_value):
                found.append(_contradiction(path, value, cfg_value, cfg_key))
            continue
        if path not in expected:
            if value == AUTO:
                found.append(Problem(f"parallel.deepspeed.extra.{path}", '"auto" has no run-config value to fill it',
                                     fix="write an explicit value"))
            continue
        target, cfg_key = expected[path]
        if value == AUTO:
            parent[key] = target
        elif not _same(value, target):
            found.append(_contradiction(path, value, target, cfg_key))

    if problems is not None:
        problems.extend(found)
    elif found:
        raise UserError(found, title="the DeepSpeed config contradicts the run config")
    return config


def _contradiction(path: str, value: Any, target: Any, cfg_key: str) -> Problem:
    return Problem(cfg_key.split(" ")[0], f"DeepSpeed `{path}` is {value!r}, but the run config gives {target!r} ({cfg_key})",
                   fix=f'write "auto" for `{path}` so it is filled from the run config, or change {cfg_key.split(" ")[0]}')
