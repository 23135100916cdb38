"""The model split by its tensor-parallel plan, on the mesh Accelerate built.

Transformers owns the plan (a model's `base_model_tp_plan`: which projections split by column,
which by row) and the layers that run it; Accelerate owns the device mesh. `split_model` hands
the one to the other before `prepare()`, as `from_pretrained(tp_plan="auto", device_mesh=...)`
would, but for the weights already built: a model from `model.architecture` is initialised
whole from the run's seed on every rank, then each rank keeps its slice (no communication,
`src_data_rank=None`), so the initial weights are the one-process run's.

Under FSDP2 x TP, Accelerate 1.15's `_prepare_tp` turns the parameters the plan leaves whole
into replicated DTensors through `transformers.integrations.tensor_parallel.ReplicateParallel`,
which Transformers 5 no longer has. Transformers 5's own FSDP x TP shards those parameters as
they are (fully_shard composes plain and tensor-parallel DTensor parameters), so that step is
skipped while the class is missing, and `prepare()` goes straight to FSDP2.
"""

from __future__ import annotations

from typing import Any

from overdrive.config.schema import RunConfig
from overdrive.strategies import layout


def split_model(model: Any, accelerator: Any, cfg: RunConfig) -> Any:
    """Shard `model`'s planned layers over the mesh's "tp" axis (a no-op without tensor parallel)."""
    lay = layout.layout(cfg, accelerator.num_processes)
    if lay.tp == 1:
        return model
    from transformers.distributed import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    config = DistributedConfig(tp_size=lay.tp)
    # The model's plan with its `*` expanded to layer numbers (Transformers' own resolution).
    tp_plan, _, _ = model._resolve_parallel_plans(config)
    apply_tensor_parallelism(model, accelerator.torch_device_mesh["tp"], tp_plan)
    # Where Accelerate reads the model's TP degree (accelerate.utils.other.get_model_tp_size).
    model.config.distributed_config = config
    if getattr(accelerator, "is_fsdp2", False):
        _skip_replicate_conversion(accelerator)
    return model


def _skip_replicate_conversion(accelerator: Any) -> None:
    import transformers.integrations.tensor_parallel as hf_tp

    if hasattr(hf_tp, "ReplicateParallel"):
        return  # Accelerate and Transformers agree again: let Accelerate do it
    accelerator._prepare_tp = lambda *args: args  # this accelerator only
