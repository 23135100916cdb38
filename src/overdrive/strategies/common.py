"""Accelerator arguments every strategy shares."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from overdrive.config.schema import RunConfig
from overdrive.strategies import cpu, registry
from overdrive.strategies.compile import dynamo_plugin
from overdrive.strategies.precision import fp8_recipe


def base_kwargs(cfg: RunConfig, world_size: int, gpus: int | None = None) -> dict[str, Any]:
    """Precision (and its FP8 recipe), accumulation, compile, device, and the process group's
    backend and timeout.

    Every argument is passed explicitly, so Accelerate never falls back to the
    ACCELERATE_MIXED_PRECISION / ACCELERATE_GRADIENT_ACCUMULATION_STEPS / ACCELERATE_DYNAMO_*
    variables it would otherwise read.
    """
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs

    handlers: list[Any] = []
    # Only when there is a process group to make: a lone DDP process has none, and naming a
    # backend there makes Accelerate ask torch.distributed for a world size that does not exist.
    grouped = world_size > 1 or registry.of(cfg).always_grouped
    if grouped:
        # The timeout, for every strategy: rank 0 tokenizes and checksums alone while the
        # others wait in a barrier, and torch's default on nccl (10 minutes) is shorter than
        # that on large data. backend=None lets Accelerate pick (nccl on CUDA).
        handlers.append(InitProcessGroupKwargs(backend=cpu.process_group_backend(cfg, gpus),
                                               timeout=timedelta(minutes=cfg.launch.timeout_minutes)))
    recipe = fp8_recipe(cfg)
    if recipe is not None:
        handlers.append(recipe)
    return {
        "mixed_precision": cfg.precision.mixed_precision,
        # The step ends after its accumulation's micro-batches, never at the end of the data: the loop
        # draws a step's micro-batches ahead, so the loader is at its end while the last step of an
        # epoch still has micro-batches to run (Accelerate would sync, and the optimizer step, at each).
        "gradient_accumulation_plugin": GradientAccumulationPlugin(
            num_steps=cfg.training.gradient_accumulation_steps, sync_with_dataloader=False),
        "cpu": cpu.construct_with_cpu_flag(cfg, gpus),
        "dynamo_plugin": dynamo_plugin(cfg),
        "kwargs_handlers": handlers,
        # Pinned host batches are only worth it when the copy to the device does not wait for
        # them: Accelerate's prepared loaders copy with non_blocking from this setting alone.
        "dataloader_config": DataLoaderConfiguration(non_blocking=cfg.data.pin_memory),
    }
