"""Plain data parallel (and the single-process path): one full replica per rank,
gradients all-reduced in buckets during backward."""

from __future__ import annotations

from typing import Any

from overdrive.config.schema import RunConfig
from overdrive.strategies import common


def accelerator_kwargs(cfg: RunConfig, world_size: int, gpus: int | None = None) -> dict[str, Any]:
    from accelerate.utils import DistributedDataParallelKwargs

    ddp = cfg.parallel.ddp
    kwargs = common.base_kwargs(cfg, world_size, gpus)
    kwargs["kwargs_handlers"].append(
        DistributedDataParallelKwargs(
            find_unused_parameters=ddp.find_unused_parameters,
            bucket_cap_mb=ddp.bucket_cap_mb,
            broadcast_buffers=ddp.broadcast_buffers,
            gradient_as_bucket_view=ddp.gradient_as_bucket_view,
            static_graph=ddp.static_graph,
        )
    )
    return kwargs
