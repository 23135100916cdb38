"""How a checkpoint gets into a run on another world size or strategy (decided from configs alone).

A checkpoint records the config it was written under; comparing it with this run's config
gives a `Route`:

- as saved: same strategy, same world size. `accelerator.load_state` reads it back as is.
- accelerate: the files hold whole tensors (DDP, FSDP2 full state dict), so any world size
  reads them.
- dcp: FSDP2's sharded state dict is a `torch.distributed.checkpoint` directory, which loads
  into any sharding (DCP matches saved chunks to the new shards by global offset).
- universal: ZeRO partitions are split per rank; DeepSpeed's universal checkpoint
  (deepspeed/checkpoint/ds_to_universal.py) rewrites them once per parameter, and a run of
  any world size loads that with `checkpoint.load_universal`.
- tensor parallel: a tensor-parallel run without FSDP writes its model and optimizer as a DCP
  directory (checkpoint/tensor_parallel.py), which loads into any tp_size and world size of a
  run without FSDP or DeepSpeed. Under FSDP2 the layout (HSDP, FSDP x TP) is DCP's own
  business: FSDP2's sharded state dict loads into another mesh of the same strategy.
- pipeline: pipeline stages write one DCP directory under the whole model's parameter names
  (checkpoint/pipeline_state.py), which loads into stages of any layout, or into a DDP run.
- across: another strategy. The saved weights and Adam moments are read as whole tensors
  keyed by parameter name (from DDP's files, FSDP2's DCP, or ZeRO's universal checkpoint) and
  placed with `torch.distributed.checkpoint.state_dict.set_state_dict`, which shards them
  for the new strategy.

Nothing here imports torch: `plan_resume` asks before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from overdrive.config.batch import combinations as batch_combinations  # noqa: F401 (asked for by refusals here)
from overdrive.strategies import layout as nd
from overdrive.strategies import registry

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

# (from, to) strategy families a checkpoint can move between, and the reader of the source.
_ACROSS = {
    ("ddp", "fsdp"): "DDP's whole tensors, sharded by set_state_dict",
    ("fsdp", "ddp"): "FSDP2's DCP directory, gathered by torch.distributed.checkpoint",
    ("deepspeed", "fsdp"): "DeepSpeed's universal checkpoint, sharded by set_state_dict",
    ("deepspeed", "ddp"): "DeepSpeed's universal checkpoint, as whole tensors",
}
_INTO_DEEPSPEED = ("DeepSpeed reads only its own checkpoints (or its universal format, which only DeepSpeed "
                   "writes)")


def label(config: RunConfig) -> str:
    """The strategy as a person names it, with its mesh where it has one: DDP, ZeRO-2 (optimizer
    offload to cpu), FSDP2 (dp_shard 2 x tp 2)."""
    mesh = nd.layout(config).mesh
    described = " x ".join(f"{name} {size}" for name, size in mesh if name not in ("dp_replicate", "dp_shard")
                           or len(mesh) > 1)
    return registry.of(config).person_name(config) + (f" ({described})" if described else "")


def _layout(config: RunConfig) -> tuple:
    """What decides the files' format (offload does not: ZeRO saves the same files with or without it)."""
    lay, files = nd.layout(config), registry.of(config).checkpoint_format(config)
    if lay.pp > 1:
        return (files[0], "pipeline")  # one DCP directory under the whole model's names
    if len(files) == 1 and lay.tp > 1:
        return (files[0], "tensor parallel")  # a DCP directory, not Accelerate's files
    return files


def _processes(n: int) -> str:
    return f"{n} process" + ("" if n == 1 else "es")


@dataclass(frozen=True)
class Route:
    how: str  # as saved | accelerate | dcp | universal | across | refused
    source: str  # labels, e.g. "ZeRO-2"
    target: str
    source_world: int
    target_world: int
    reader: str = ""  # for `across`: what reads the source
    refusal: str = ""

    @property
    def reshards(self) -> bool:
        return self.how not in ("as saved", "refused")

    @property
    def universal(self) -> bool:
        """The source is read through DeepSpeed's universal checkpoint (converted once, cached)."""
        return self.source.startswith("ZeRO") and self.how in ("universal", "across")

    def summary(self) -> str:
        """"ZeRO-2 on 2 processes -> ZeRO-2 on 1 process (DeepSpeed universal checkpoint)"."""
        via = {"accelerate": "whole tensors, read at any world size",
               "dcp": "torch.distributed.checkpoint resharding",
               "universal": "DeepSpeed universal checkpoint",
               "across": self.reader}.get(self.how, self.how)
        return (f"{self.source} on {_processes(self.source_world)} -> {self.target} on "
                f"{_processes(self.target_world)} ({via})")


def route(saved: RunConfig, current: RunConfig) -> Route:
    """How the checkpoint written under `saved` loads into a run of `current` (or why it cannot)."""
    w_old, w_new = saved.launch.num_processes, current.launch.num_processes
    a, b = _layout(saved), _layout(current)
    base: dict[str, Any] = dict(source=label(saved), target=label(current), source_world=w_old, target_world=w_new)
    if "pipeline" in a + b and (a != b or w_old != w_new or nd.layout(saved).mesh != nd.layout(current).mesh):
        if a[1:] == ("pipeline",) and (b[0] == "ddp" or b[1:] == ("pipeline",)):
            return Route("dcp", **base, reader="torch.distributed.checkpoint resharding")
        return Route("refused", **base, refusal=f"a {base['source']} checkpoint cannot continue under {base['target']}: "
                     "pipeline stages' checkpoints load into pipeline stages of any layout (DDP or FSDP2 beside them) or "
                     "into DDP (with or without tensor parallel); other files do not load into stages")
    if "tensor parallel" in a + b and a != b:
        if a[1:] == ("tensor parallel",) and b[0] == "ddp":
            return Route("dcp", **base, reader="torch.distributed.checkpoint resharding")
        return Route("refused", **base, refusal=f"a {base['source']} checkpoint cannot continue under {base['target']}: "
                     "tensor-parallel shards (without FSDP) are read by torch.distributed.checkpoint into DDP runs "
                     "only, and other files do not load into tensor-parallel slices. Possible moves: DDP (tp N) -> "
                     "DDP at any tp_size and world size; FSDP2 (any dp_replicate x dp_shard x tp) -> FSDP2 at another "
                     "mesh; the same layout at another world size")
    if a == b:
        if w_old == w_new and (a[0] != "fsdp" or nd.layout(saved).mesh == nd.layout(current).mesh):
            return Route("as saved", **base)
        if a[0] == "ddp" or (a[0] == "fsdp" and a[2] == "full_state_dict"):
            return Route("accelerate", **base)
        if (a[0] == "fsdp" and a[1] == 2) or a[1:] == ("tensor parallel",):
            return Route("dcp", **base, reader="torch.distributed.checkpoint resharding")
        if a[0] == "deepspeed" and a[1] >= 1:
            nvme = "nvme" in (saved.parallel.deepspeed.offload_optimizer, current.parallel.deepspeed.offload_optimizer)
            if nvme:
                return Route("refused", **base, refusal="ZeRO with NVMe optimizer offload keeps per-rank swap "
                             "files that the universal checkpoint does not cover")
            return Route("universal", **base)
        return Route("refused", **base, refusal=f"{base['source']} checkpoints are one shard per rank and have no "
                     "resharding reader here")
    pair = (a[0], b[0])
    if pair in _ACROSS and (a[0] != "deepspeed" or a[1] >= 1) and all(x[0] != "fsdp" or x[1] == 2 for x in (a, b)):
        if a[0] == "fsdp" and a[2] != "sharded_state_dict":
            return Route("refused", **base, refusal="only FSDP2's sharded (DCP) checkpoints move to another strategy")
        return Route("across", **base, reader=_ACROSS[pair])
    if b[0] == "deepspeed" and a[0] != "deepspeed":
        why = _INTO_DEEPSPEED
    elif a[0] == b[0] == "deepspeed":
        why = "ZeRO stages name and partition their files differently"
    else:
        why = f"no reader from {base['source']} files into {base['target']}"
    return Route("refused", **base, refusal=f"a {base['source']} checkpoint cannot continue under {base['target']}: "
                 f"{why}. Possible moves: DDP <-> FSDP2, ZeRO-1/2/3 -> FSDP2 or DDP, and any strategy to "
                 "another world size")
