"""Plain data parallel (and the single-process path)."""

from __future__ import annotations

from typing import Any

from overdrive.config.schema import RunConfig


def accelerator_kwargs(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    from accelerate.utils import DistributedDataParallelKwargs

    ddp = cfg.parallel.ddp
    return {
        "mixed_precision": cfg.precision.mixed_precision,
        "gradient_accumulation_steps": cfg.training.gradient_accumulation_steps,
        "cpu": cfg.launch.use_cpu,
        "kwargs_handlers": [
            DistributedDataParallelKwargs(
                find_unused_parameters=ddp.find_unused_parameters,
                bucket_cap_mb=ddp.bucket_cap_mb,
                broadcast_buffers=ddp.broadcast_buffers,
                gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                static_graph=ddp.static_graph,
            )
        ],
    }
