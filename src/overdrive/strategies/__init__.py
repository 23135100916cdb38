"""Run config -> Accelerator. One pure function per strategy, one place that builds.

`accelerator_kwargs(cfg, world)` returns the keyword arguments for `Accelerator(...)`;
`build_accelerator(cfg)` constructs it. Plugins are always built explicitly from the config,
so nothing is read from `ACCELERATE_*` environment variables behind the user's back.
"""

from __future__ import annotations

from typing import Any

from overdrive.config.schema import RunConfig


def accelerator_kwargs(cfg: RunConfig, world_size: int = 1) -> dict[str, Any]:
    from overdrive.strategies import ddp

    return ddp.accelerator_kwargs(cfg, world_size)


def build_accelerator(cfg: RunConfig, world_size: int | None = None, **extra_kwargs: Any):
    """An Accelerator configured from `cfg` alone.

    `extra_kwargs` (e.g. `log_with`, `project_dir` from the trainer) are merged into the
    Accelerator arguments and win over the ones derived from `cfg`.
    """
    from accelerate import Accelerator

    return Accelerator(**{**accelerator_kwargs(cfg, world_size or 1), **extra_kwargs})
