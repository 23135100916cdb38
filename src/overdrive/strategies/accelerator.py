"""The Accelerator for a run: its arguments and plugins from the registry, construction with the CPU
workarounds, what the strategy cannot do on this machine, and the model split for the layout."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem
from overdrive.strategies import registry


def _strategy_module(name: str) -> ModuleType:
    """The module that builds Accelerate's plugin for strategy `name` (imported when asked: DeepSpeed's is heavy)."""
    if name == "deepspeed":
        from overdrive.strategies import deepspeed
        return deepspeed
    if name == "fsdp":
        from overdrive.strategies import fsdp
        return fsdp
    from overdrive.strategies import ddp
    return ddp


def accelerator_kwargs(cfg: RunConfig, world_size: int = 1, gpus: int | None = None) -> dict[str, Any]:
    """Keyword arguments for `Accelerator(...)`, from the config and the world size alone.
    `gpus`: describe the machine (its GPU count) instead of asking torch on this one."""
    from overdrive.strategies import cpu, layout

    module = _strategy_module(cfg.parallel.strategy)

    kwargs = module.accelerator_kwargs(cfg, world_size, gpus)
    if not cpu.on_cpu(cfg, gpus):
        # On CPU Accelerate refuses a ParallelismConfig (MULTI_CPU): cpu.py attaches it after construction.
        parallelism = layout.parallelism_config(cfg, world_size)
        if parallelism is not None:
            kwargs["parallelism_config"] = parallelism
    return kwargs


def shards_parameters(cfg: RunConfig) -> bool:
    """FSDP and ZeRO-3: no rank ever holds the whole model (outside a gather)."""
    return not registry.of(cfg).holds_whole_model(cfg)


def loss_scaler_owns_overflows(cfg: RunConfig) -> bool:
    """The strategy's engine skips overflowing fp16 steps itself (`Strategy.skips_overflowing_steps`)."""
    return registry.of(cfg).skips_overflowing_steps(cfg)


def use_split(accelerator: Any, micro: int, accumulation: int) -> None:
    """Tell a constructed Accelerator (and DeepSpeed's config, read only in prepare()) a batch
    split settled after construction (the auto micro-batch); the global batch is unchanged."""
    accelerator.gradient_accumulation_steps = accumulation
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro
        plugin.deepspeed_config["gradient_accumulation_steps"] = accumulation
        plugin.gradient_accumulation_steps = accumulation


def problems(cfg: RunConfig, world_size: int | None = None, gpus: int | None = None) -> list[Problem]:
    """What this strategy cannot do with this config on this machine (or, given `gpus`, on
    machines with that many GPUs: a script written for a cluster), named by key.

    Includes the DeepSpeed dict's contradictions (an explicit `parallel.deepspeed.extra`
    entry against the run config). Cheap: builds no plugin and imports no deepspeed.
    """
    from overdrive.config.batch import data_parallel_degree
    from overdrive.strategies import cpu, layout

    found = layout.problems(cfg) + cpu.problems(cfg, gpus)
    if registry.of(cfg).deepspeed_config:
        from overdrive.strategies.deepspeed_config import ds_config

        ds_config(cfg, world_size or data_parallel_degree(cfg), problems=found, find_hidden_size=False)
    return found


def construct_accelerator(cfg: RunConfig, world_size: int | None = None, **extra_kwargs: Any):
    """An Accelerator configured from `cfg` alone, in a process already prepared for it
    (`overdrive.build_accelerator` prepares the process, then calls this).

    `extra_kwargs` (log_with, project_dir, ...) are merged into the Accelerator call;
    `kwargs_handlers` given there are added to overdrive's own.
    """
    from overdrive.errors import UserError
    from overdrive.strategies import cpu

    world = world_size or cfg.launch.num_processes
    found = cpu.problems(cfg)
    if found:
        raise UserError(found)

    # 1. The process environment Accelerate and DeepSpeed read (DS_ACCELERATOR, rank variables)
    #    was set by the caller: launch/process.py, the one place that writes those.
    # 2. Arguments from the config: every plugin built here, explicitly.
    kwargs = accelerator_kwargs(cfg, world)
    for key, value in extra_kwargs.items():
        if key == "kwargs_handlers":
            kwargs["kwargs_handlers"] = kwargs["kwargs_handlers"] + list(value or [])
        else:
            kwargs[key] = value

    # 3. Construct: this initialises the process group.
    from accelerate import Accelerator

    accelerator = Accelerator(**kwargs)

    # 4. Fix-ups that must land before prepare() wraps anything, and before the caller
    #    builds its model: FSDP on CPU needs its state marked FSDP (cpu.py); ZeRO-3 without
    #    zero3_init must stop Transformers from building models pre-partitioned.
    if cpu.needs_fsdp_promotion(cfg):
        cpu.promote_to_fsdp(accelerator, kwargs["fsdp_plugin"])
    if cpu.on_cpu(cfg):
        cpu.attach_parallelism(accelerator, cfg, world)
    if cfg.parallel.strategy == "deepspeed":
        from overdrive.strategies import deepspeed

        deepspeed.after_construction(accelerator, cfg)
    return accelerator


def split_model(model: Any, accelerator: Any, cfg: RunConfig) -> Any:
    """The model split by its tensor-parallel plan when the layout has tp_size > 1, and its experts
    by their expert-parallel plan when ep_size > 1 (before prepare); under FSDP2, the layer classes it is
    wrapped by settled to those it holds."""
    from overdrive.strategies import expert_parallel, fsdp, tensor_parallel

    fsdp.wrap_layers_it_holds(accelerator, model)
    return expert_parallel.split_experts(tensor_parallel.split_model(model, accelerator, cfg), accelerator, cfg)


def hook_optimizer(optimizer: Any, model: Any) -> None:
    """The optimizer of a model whose experts `split_model` split: its state saved whole (a no-op otherwise)."""
    from overdrive.strategies import expert_parallel

    expert_parallel.hook_optimizer(optimizer, model)


def shard_fraction(model: Any) -> float:
    """Fraction of the model's parameter elements held by this rank (after prepare)."""
    from overdrive.strategies import deepspeed, fsdp

    if any(hasattr(p, "ds_numel") for p in model.parameters()):
        return deepspeed.shard_fraction(model)
    return fsdp.shard_fraction(model)
