"""Accelerate's `distributed_type: MEGATRON_LM` and its `megatron_lm_config:` block, read key by
key onto overdrive's layout: Megatron's tensor and pipeline degrees become parallel.tp_size and
parallel.pp_size, run through torch's own tensor and pipeline parallel (megatron-core is not
needed). The names are Accelerate's (accelerate/commands/config/cluster.py writes them,
utils/launch.py turns them into MEGATRON_LM_* variables for MegatronLMPlugin). What has no
counterpart here is refused by key when it is switched on; switched off, it asks for nothing.
Used by interop/reading.py; `megatron_section` is what interop/writing.py writes back.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

# megatron_lm_config key: the overdrive key it sets.
MEGATRON_KEYS = {
    "megatron_lm_tp_degree": "parallel.tp_size",
    "megatron_lm_pp_degree": "parallel.pp_size",
    "megatron_lm_num_micro_batches": "parallel.pp_microbatches",
    "megatron_lm_gradient_clipping": "training.gradient_clipping",
    "megatron_lm_recompute_activations": "model.gradient_checkpointing",
    "megatron_lm_context_parallel_size": "parallel.cp_size",
    "megatron_lm_expert_model_parallel_size": "parallel.ep_size",
}

# Megatron-LM's own mixture-of-experts arguments, as `other_megatron_args` hands them over: the
# overdrive key each sets (the rest of other_megatron_args is refused).
MEGATRON_MOE_ARGS = {
    "expert_model_parallel_size": "parallel.ep_size",
    "moe_router_topk": "model.moe.top_k",
    "moe_aux_loss_coeff": "model.moe.aux_loss_coef",
    "moe_router_load_balancing_type": "model.moe.aux_loss_scope",
}
# Megatron's load-balancing types: `aux_loss` is taken per micro-batch, `seq_aux_loss` per sequence
# (DeepSeek-V3's); `none` is a coefficient of 0.
_BALANCING = {"aux_loss": "micro_batch", "seq_aux_loss": "sequence"}

# Keys Accelerate has that ask for what overdrive does not do: why, and the fix.
MEGATRON_REFUSED = {
    "megatron_lm_sequence_parallelism": (
        "Megatron's sequence parallelism (norms and dropout split along the sequence inside the tensor-parallel "
        "group) has no counterpart: tensor parallel here runs Transformers' plan, which keeps those activations whole",
        "set it to false (for long sequences: parallel.cp_size with fsdp)"),
    "megatron_lm_use_distributed_optimizer": (
        "shards the optimizer state over the data-parallel ranks beside pipeline stages, which is not composed here",
        "set it to false"),
    "megatron_lm_use_custom_fsdp": ("Megatron's own FSDP is not run", "set it to false (or use parallel.strategy=fsdp)"),
    "megatron_lm_recompute_granularity": ("recomputation here is of whole decoder layers (model.gradient_checkpointing)",
                                          "remove it; megatron_lm_recompute_activations maps onto whole layers"),
    "megatron_lm_recompute_method": ("recomputation here is of whole decoder layers (model.gradient_checkpointing)",
                                     "remove it"),
    "megatron_lm_decoder_last_pipeline_num_layers": (
        "stages hold the same number of decoder layers here", "remove it; choose a pp_degree that divides the layers"),
    "megatron_lm_optimizer_cpu_offload": ("Megatron's optimizer offload is not run", "set it to false"),
    "megatron_lm_use_precision_aware_optimizer": ("Megatron's precision-aware optimizer is not run", "set it to false"),
    "megatron_lm_overlap_cpu_optimizer_d2h_h2d": ("Megatron's optimizer offload is not run", "set it to false"),
    "megatron_lm_no_load_optim": ("checkpoints here always carry the optimizer", "set it to false"),
    "megatron_lm_no_save_optim": ("checkpoints here always carry the optimizer", "set it to false"),
    "megatron_lm_eod_mask_loss": ("the loss here covers every token of packed text, end-of-document ones included",
                                  "set it to false"),
    "other_megatron_args": ("Megatron-LM's own arguments are not read (but for its mixture-of-experts ones: "
                            + ", ".join(MEGATRON_MOE_ARGS) + ")", "remove them"),
    "megatron_lm_recompute_num_layers": ("recomputation here is of every decoder layer (model.gradient_checkpointing)",
                                         "remove it"),
    "megatron_lm_expert_tensor_parallel_size": ("experts are kept whole on their expert-parallel rank here (no "
                                                "tensor parallel inside an expert)", "remove it (or set it to 1)"),
    "megatron_lm_attention_backend": ("the attention kernel is the model's (model.attn_implementation)",
                                      "remove it; set model.attn_implementation"),
    "megatron_lm_attention_dropout": ("dropout is the model's own config", "remove it; set it in model.architecture"),
    "megatron_lm_hidden_dropout": ("dropout is the model's own config", "remove it; set it in model.architecture"),
    "megatron_lm_attention_softmax_in_fp32": ("the softmax precision is the model's attention kernel's",
                                              "remove it"),
    "megatron_lm_use_rotary_position_embeddings": ("position embeddings are the model's own (Llama-like models "
                                                   "rotate, GPT-2 learns them)", "remove it"),
}
# Keys that ask for what the pipeline does anyway: read, nothing to set.
MEGATRON_AS_IS = {
    "megatron_lm_calculate_per_token_loss": "the pipeline's step loss is the token mean over the step's samples",
}

def _asks_for(key: str, value: Any) -> bool:
    """Whether a value switches something on: true, a size above 1, another number but 0, a name."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, (int, float)):
        return value > 1 if key.endswith("_size") else value != 0
    return str(value).strip().lower() not in ("", "false", "no", "0", "none", "null")


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("true", "yes", "1", "on") if isinstance(value, str) else bool(value)


def map_megatron(data: Mapping[str, Any], c: Any, distributed_type: str) -> None:
    """The `megatron_lm_config` of an Accelerate config, through the collector `c`
    (reading._Collector): read under MEGATRON_LM, dropped (as Accelerate drops it) otherwise."""
    block = data.get("megatron_lm_config")
    if not block:
        return
    if distributed_type != "MEGATRON_LM":
        c.warn(("megatron_lm_config",), f"ignored: distributed_type is {distributed_type}, so Accelerate drops it")
        return
    if not isinstance(block, Mapping):
        c.error(("megatron_lm_config",), f"must be a mapping of keys to values, got {block!r}")
        return
    path = ("megatron_lm_config",)
    c.set("parallel.strategy", "ddp", *path)  # the replicas beside the stages: plain data parallel
    for key, value in block.items():
        where = path + (key,)
        if key == "other_megatron_args" and isinstance(value, Mapping):
            _other_args(value, c, where)
            continue
        if key in MEGATRON_REFUSED:
            if _asks_for(key, value):
                why, fix = MEGATRON_REFUSED[key]
                c.error(where, f"{value!r}: {why}", fix)
            continue
        if key in MEGATRON_AS_IS:
            continue
        target = MEGATRON_KEYS.get(key)
        if target is None:
            close = difflib.get_close_matches(str(key), [*MEGATRON_KEYS, *MEGATRON_REFUSED, *MEGATRON_AS_IS], n=1)
            c.error(where, "not a megatron_lm_config key" + (f" (did you mean `{close[0]}`?)" if close else ""))
        elif value is None:
            continue
        elif key == "megatron_lm_gradient_clipping":
            c.set(target, None if float(value) == 0 else float(value), *where)  # Megatron's 0: no clipping
        elif key == "megatron_lm_recompute_activations":
            c.set(target, _truthy(value), *where)
            if _truthy(value):
                c.warn(where, "Megatron recomputes the attention core only (selective); here whole decoder layers are "
                       "recomputed (model.gradient_checkpointing): less memory, more compute")
        else:
            c.set(target, value, *where)


def _other_args(args: Mapping[str, Any], c: Any, path: tuple) -> None:
    """Megatron-LM's own arguments: its mixture-of-experts ones read, any other that asks for
    something refused (the number of experts is the model's own config)."""
    for key, value in args.items():
        where = path + (key,)
        target = MEGATRON_MOE_ARGS.get(key)
        if target is None:
            if key == "num_moe_experts" and value:
                c.error(where, f"{value!r}: the number of experts is the model's own config",
                        "remove it; set model.architecture.num_experts (or the config of model.name_or_path)")
            elif _asks_for(key, value):
                c.error(where, f"{value!r}: Megatron-LM's own arguments are not read (but for "
                        + ", ".join(MEGATRON_MOE_ARGS) + ")", "remove it")
        elif key == "moe_router_load_balancing_type":
            if value == "none":
                c.set("model.moe.aux_loss_coef", 0.0, *where)
            elif value in _BALANCING:
                c.set(target, _BALANCING[value], *where)
            else:
                c.error(where, f"{value!r}: the balance loss here is aux_loss (per micro-batch), seq_aux_loss (per "
                        "sequence) or none", "use one of them (Megatron's sinkhorn and global_aux_loss are not run)")
        elif value is not None:
            c.set(target, value, *where)


def megatron_section(cfg: RunConfig) -> dict[str, Any]:
    """The `megatron_lm_config:` block `export` writes for a layout with pipeline stages: the
    keys above that map, read back off the run config (the inverse of `map_megatron`)."""
    from overdrive.strategies import pipeline

    t = cfg.training
    return {"megatron_lm_tp_degree": cfg.parallel.tp_size, "megatron_lm_pp_degree": cfg.parallel.pp_size,
            "megatron_lm_num_micro_batches": pipeline.microbatches(cfg),
            "megatron_lm_gradient_clipping": t.gradient_clipping or 0.0,
            "megatron_lm_recompute_activations": cfg.model.gradient_checkpointing,
            "megatron_lm_sequence_parallelism": False, "megatron_lm_use_distributed_optimizer": False,
            **({"megatron_lm_expert_model_parallel_size": cfg.parallel.ep_size} if cfg.parallel.ep_size > 1 else {})}
