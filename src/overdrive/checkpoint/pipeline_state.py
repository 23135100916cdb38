"""Checkpoints of pipeline stages, through torch.distributed.checkpoint.

Under pipeline parallel Accelerate holds neither the model nor the optimizer (each rank holds
its stages: training/step/pipeline.py), so `save_state` writes the rest (schedule, RNG, samplers)
and the stages' weights and optimizer state go into one DCP directory, keyed by the whole
model's parameter names (a stage's own prefix taken off) with the optimizer state flattened
per parameter (torch's `flatten_optimizer_state_dict`, as torchtitan saves several optimizers
in one checkpoint). The directory is then the same whatever the stages were: it loads into
another pipeline layout, or into one whole model under plain DDP (DCP matches the saved
tensors by name, and shards them for tensor parallel).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from overdrive.checkpoint import tensor_parallel

DIRECTORY = "pipeline_dcp"
# "0.lm.model.layers.2.mlp.up_proj.weight" (stage 0 of this rank) -> "model.layers.2.mlp.up_proj.weight";
# flattened optimizer keys carry a "state." or "param_groups." head.
_STAGE_PREFIX = re.compile(r"^((?:state|param_groups)\.)?\d+\.lm\.")


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _whole_names(values: dict[str, Any], back: dict[str, str]) -> dict[str, Any]:
    renamed = {}
    for key, value in values.items():
        whole = _STAGE_PREFIX.sub(r"\1", key)
        back[whole] = key
        renamed[whole] = value
    return renamed


def _stage_state(stages: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """The stages' model and (flattened) optimizer state under the whole model's names, and the
    way back to the stages' own keys."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(stages, optimizer, options=_options())
    back: dict[str, str] = {}
    return {"model": _whole_names(model_state, back), "optimizer": _whole_names(optimizer_state, back)}, back


def save_state(accelerator: Any, path: Path, pipeline: Optional[Any], stages: Any = None, optimizer: Any = None,
               **kwargs: Any) -> None:
    """A pipeline run's checkpoint (any other run's: tensor_parallel.save_state)."""
    if pipeline is None:
        tensor_parallel.save_state(accelerator, path, **kwargs)
        return
    import torch.distributed.checkpoint as dcp

    accelerator.save_state(str(path), **kwargs)
    state, _ = _stage_state(stages, optimizer)
    dcp.save(state, checkpoint_id=str(Path(path) / DIRECTORY))


def load_state(accelerator: Any, path: Path, pipeline: Optional[Any], stages: Any = None, optimizer: Any = None,
               **kwargs: Any) -> None:
    """Load `path` into this run: a pipeline checkpoint into stages or into one whole model
    (DDP, tensor parallel); anything else as tensor_parallel.load_state does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    source = Path(path) / DIRECTORY
    if pipeline is not None:
        accelerator.load_state(str(path), **kwargs)  # schedule, RNG, samplers
        state, back = _stage_state(stages, optimizer)
        dcp.load(state, checkpoint_id=str(source))
        own = {part: {back[k]: v for k, v in values.items()} for part, values in state.items()}
        set_state_dict(stages, optimizer, model_state_dict=own["model"], optim_state_dict=own["optimizer"],
                       options=_options())
        return
    if not source.is_dir():
        tensor_parallel.load_state(accelerator, path, **kwargs)
        return
    with tensor_parallel.set_aside(accelerator) as (model, whole_optimizer):
        accelerator.load_state(str(path), **kwargs)
        model_state, optimizer_state = get_state_dict(model, whole_optimizer, options=_options())
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(source))
        set_state_dict(model, whole_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=_options())
