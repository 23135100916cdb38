"""A frozen model beside the trained one (a distillation teacher), placed as the run's strategy
places the trained model, so no rank holds it whole where the strategy shards the student:

- FSDP2: each decoder layer (the model's `_no_split_modules`, as Accelerate wraps the student)
  and then the root sharded with `fully_shard` over the run's mesh, with the student's
  mixed-precision and offload policies (the root through TRL's `prepare_fsdp`, as TRL shards its
  reference and teacher models): a forward gathers one layer at a time;
- ZeRO-3: DeepSpeed's engine without an optimizer (TRL's `prepare_deepspeed`), which gathers
  each module's partitions as its forward runs;
- otherwise: whole on the device (DDP, ZeRO-1/2, one process).

It is loaded on the host first and only its shards go to the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from overdrive.config.schema import RunConfig
from overdrive.strategies import registry

if TYPE_CHECKING:
    from accelerate import Accelerator


def load_device(cfg: RunConfig, device: torch.device) -> torch.device:
    """Where a frozen model is loaded before it is placed: the host where the strategy shards it."""
    return device if registry.of(cfg).holds_whole_model(cfg) else torch.device("cpu")


def place(model: torch.nn.Module, cfg: RunConfig, accelerator: "Accelerator") -> Any:
    """`model` (frozen, in eval mode) placed as the run's strategy places the trained model."""
    strategy = registry.of(cfg)
    if strategy.holds_whole_model(cfg):
        return model.to(accelerator.device).eval()
    if strategy.deepspeed_config:  # ZeRO-3
        from trl.models.utils import prepare_deepspeed

        return prepare_deepspeed(model, accelerator)
    return _fully_sharded(model, accelerator)


def _fully_sharded(model: torch.nn.Module, accelerator: "Accelerator") -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from trl.models.utils import prepare_fsdp

    plugin = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = {"reshard_after_forward": plugin.reshard_after_forward, "offload_policy": plugin.cpu_offload,
              "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
              "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None}
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layers:
            fully_shard(module, **kwargs)
    return prepare_fsdp(model, accelerator)


def held_here(model: Any) -> tuple[int, int]:
    """(parameters this rank holds, parameters of the whole model): an FSDP2 shard is its local tensor,
    a ZeRO-3 partition its `ds_tensor`."""
    module = getattr(model, "module", model)  # DeepSpeed's engine wraps the model
    held = total = 0
    for param in module.parameters():
        if hasattr(param, "ds_numel"):  # ZeRO-3: the partition this rank keeps
            total += param.ds_numel
            held += param.ds_tensor.numel()
        elif hasattr(param, "to_local"):  # a DTensor: this rank's shard
            total += param.numel()
            held += param.to_local().numel()
        else:
            total += param.numel()
            held += param.numel()
    return held, total
