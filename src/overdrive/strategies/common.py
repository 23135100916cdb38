"""Accelerator arguments every strategy shares."""

from __future__ import annotations

from typing import Any

from overdrive.config.schema import RunConfig
from overdrive.strategies import cpu, registry
from overdrive.strategies.compile import dynamo_plugin


def base_kwargs(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """Precision, accumulation, compile, device and process-group backend.

    Every argument is passed explicitly, so Accelerate never falls back to the
    ACCELERATE_MIXED_PRECISION / ACCELERATE_GRADIENT_ACCUMULATION_STEPS / ACCELERATE_DYNAMO_*
    variables it would otherwise read.
    """
    handlers: list[Any] = []
    backend = cpu.process_group_backend(cfg)
    # Only when there is a process group to make: a lone DDP process has none, and naming a
    # backend there makes Accelerate ask torch.distributed for a world size that does not exist.
    grouped = world_size > 1 or registry.of(cfg).always_grouped
    if backend is not None and grouped:
        from accelerate.utils import InitProcessGroupKwargs

        handlers.append(InitProcessGroupKwargs(backend=backend))
    return {
        "mixed_precision": cfg.precision.mixed_precision,
        "gradient_accumulation_steps": cfg.training.gradient_accumulation_steps,
        "cpu": cpu.construct_with_cpu_flag(cfg),
        "dynamo_plugin": dynamo_plugin(cfg),
        "kwargs_handlers": handlers,
    }
