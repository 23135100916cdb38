"""Checkpoints of a tensor-parallel model without FSDP, through torch.distributed.checkpoint.

Accelerate 1.15's `save_state` writes a non-FSDP model through safetensors from the main
process, which cannot read a DTensor's storage, and the optimizer with torch.save from the
main process alone, which would keep only rank 0's slices. So under tensor parallel (without
FSDP, whose own path is DCP already) the model and optimizer are set aside while Accelerate
saves or loads the rest (schedule, RNG, samplers), and go through DCP here, one shard per
rank; DCP reshards on load, which is also how such a checkpoint moves to another layout.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

DIRECTORY = "tensor_parallel_dcp"


def applies(accelerator: Any) -> bool:
    config = getattr(accelerator, "parallelism_config", None)
    return bool(config and config.tp_enabled and not accelerator.is_fsdp2)


def _reads(accelerator: Any, path: Path) -> bool:
    """A tensor-parallel checkpoint loads through DCP into a run without FSDP or DeepSpeed,
    at any tp_size (routes.py refuses the rest before anything is built)."""
    from accelerate.utils import DistributedType

    return (Path(path) / DIRECTORY).is_dir() and not accelerator.is_fsdp2 \
        and accelerator.distributed_type != DistributedType.DEEPSPEED

@contextlib.contextmanager
def set_aside(accelerator: Any) -> Iterator[tuple[Any, Any]]:
    """The accelerator's one model and optimizer, taken out of its lists while DCP saves or loads
    them itself (Accelerate's save_state/load_state then handles the rest: RNG, schedule, scaler)."""
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models, accelerator._optimizers = [], []
    try:
        yield models[0], optimizers[0]
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


def save_state(accelerator: Any, path: Path, **kwargs: Any) -> None:
    """`accelerator.save_state(path, **kwargs)`, the model and optimizer through DCP when it applies."""
    if not applies(accelerator):
        accelerator.save_state(str(path), **kwargs)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with set_aside(accelerator) as (model, optimizer):
        accelerator.save_state(str(path), **kwargs)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(Path(path) / DIRECTORY))


def load_state(accelerator: Any, path: Path, **kwargs: Any) -> None:
    """`accelerator.load_state(path, **kwargs)`, the model and optimizer through DCP when it applies."""
    if not _reads(accelerator, path):
        accelerator.load_state(str(path), **kwargs)
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with set_aside(accelerator) as (model, optimizer):
        accelerator.load_state(str(path), **kwargs)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(Path(path) / DIRECTORY))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
