"""`parallel.fsdp.*` -> Accelerate's FullyShardedDataParallelPlugin (FSDP2, fully_shard).

What gets sharded: each layer class named in `parallel.fsdp.transformer_layer_cls_to_wrap`,
or, when that is empty, the model's own `_no_split_modules` (GPT2Block, LlamaDecoderLayer,
...), which Accelerate reads at prepare time; the root module is sharded last so embeddings
and head are covered too.
"""

from __future__ import annotations

from typing import Any

from overdrive.config.schema import RunConfig
from overdrive.strategies import common


def plugin(cfg: RunConfig) -> Any:
    """The FSDP plugin, every value from the config (none from FSDP_* variables)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    f = cfg.parallel.fsdp
    v2 = f.version == 2
    kwargs: dict[str, Any] = dict(
        fsdp_version=f.version,
        # FSDP2 takes a bool; FSDP1 spells the same choice as a sharding strategy.
        reshard_after_forward=f.reshard_after_forward if v2 else ("FULL_SHARD" if f.reshard_after_forward else "SHARD_GRAD_OP"),
        cpu_offload=f.offload_params,
        auto_wrap_policy=f.auto_wrap_policy,
        transformer_cls_names_to_wrap=list(f.transformer_layer_cls_to_wrap or []) or None,
        min_num_params=f.min_num_params,
        state_dict_type=f.state_dict_type.upper(),
        activation_checkpointing=f.activation_checkpointing,
        activation_checkpointing_offload=False,
        # Rank 0's whole state dict broadcast into the shards: under tensor parallel the model
        # is already split (every rank built it from the same seed), so there is nothing whole
        # to broadcast, and Accelerate's loader would copy whole tensors into TP slices.
        cpu_ram_efficient_loading=f.cpu_ram_efficient_loading and int(cfg.parallel.tp_size) == 1,
    )
    if not v2:
        # Options FSDP2 made obsolete; Accelerate warns if they are passed with version 2.
        kwargs.update(
            backward_prefetch=(f.backward_prefetch or "NO_PREFETCH").upper(),
            forward_prefetch=f.forward_prefetch,
            use_orig_params=f.use_orig_params,
            sync_module_states=f.sync_module_states,
        )
    fsdp_plugin = FullyShardedDataParallelPlugin(**kwargs)
    # The plugin falls back to FSDP_* variables for values left empty; empty is a value here
    # ("wrap the model's _no_split_modules", "ignore nothing"), so put it back after init.
    fsdp_plugin.transformer_cls_names_to_wrap = kwargs["transformer_cls_names_to_wrap"]
    fsdp_plugin.ignored_modules = f.ignored_modules
    return fsdp_plugin


def wrap_layers_it_holds(accelerator: Any, model: Any) -> None:
    """FSDP2 without `parallel.fsdp.transformer_layer_cls_to_wrap`: the model's `_no_split_modules` that it holds,
    set before prepare. A composite model names its parts' layer classes, some of which it may not hold (LLaVA's
    CLIP names CLIPTextEmbeddings beside its vision layers), and Accelerate refuses a name it cannot find."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or plugin.fsdp_version != 2 or plugin.transformer_cls_names_to_wrap:
        return
    held = {type(module).__name__ for module in model.modules()}
    named = list(getattr(model, "_no_split_modules", None) or ())
    if any(name not in held for name in named):
        plugin.transformer_cls_names_to_wrap = [name for name in named if name in held] or None


def accelerator_kwargs(cfg: RunConfig, world_size: int, gpus: int | None = None) -> dict[str, Any]:
    kwargs = common.base_kwargs(cfg, world_size, gpus)
    kwargs["fsdp_plugin"] = plugin(cfg)
    return kwargs


def shard_fraction(model: Any) -> float:
    """Fraction of the model's parameter elements held by this rank (1.0 when unsharded).

    FSDP2 parameters are DTensors: `to_local()` is this rank's shard.
    """
    local = total = 0
    for param in model.parameters():
        total += param.numel()
        local += param.to_local().numel() if hasattr(param, "to_local") else param.numel()
    return local / max(total, 1)
