"""The N-D layout as arithmetic: how `launch.num_processes` ranks split into data-parallel
replicas and shards, pipeline stages, tensor, context and sequence parallel groups (after torchtitan's
ParallelDims). The one place the degrees are worked out, the data-parallel degree of the batch
split included; strategies/layout.py adds the rules and Accelerate's objects.

    lay = layout(cfg)                  # Layout(dp_replicate=2, dp_shard=2, tp=1, cp=1, sp=1, pp=1)
    lay.data_parallel                  # dp_replicate x dp_shard = world / (pp x tp x cp x sp)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

# Accelerate's canonical mesh order (ParallelismConfig._get_mesh): outermost first. Ranks
# next to each other share the innermost axis, so TP stays within a machine. Pipeline stages
# are outermost (torchtitan's order): stage-to-stage sends may cross machines.
MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")
KEYS = {"pp": "parallel.pp_size", "dp_replicate": "parallel.dp_replicate_size", "dp_shard": "parallel.dp_shard_size",
        "tp": "parallel.tp_size", "cp": "parallel.cp_size", "sp": "parallel.sp_size"}


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    sp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp * self.cp * self.sp

    @property
    def model_parallel(self) -> int:
        """Ranks that share one batch: pp x tp x cp x sp (Accelerate's non_data_parallel_size,
        and the pipeline stages, which Accelerate does not lay out)."""
        return self.pp * self.tp * self.cp * self.sp

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches: the data-parallel degree of the batch split."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh(self) -> tuple[tuple[str, int], ...]:
        """The device mesh's axes (name, size) larger than one, in Accelerate's order."""
        return tuple((name, getattr(self, name)) for name in MESH_ORDER if getattr(self, name) > 1)

    @property
    def is_nd(self) -> bool:
        """True when Accelerate needs a ParallelismConfig: anything beyond one data-parallel axis
        (with pipeline stages the mesh is overdrive's own: training/step/pipeline.py builds it)."""
        if self.pp > 1:
            return False
        return self.tp * self.cp * self.sp > 1 or (self.dp_replicate > 1 and self.dp_shard > 1)

    @property
    def has_axes(self) -> bool:
        """More than one data-parallel axis, or any model-parallel one: what explain and plan show."""
        return self.is_nd or self.pp > 1

    def describe(self) -> str:
        return " x ".join(f"{name} {size}" for name, size in self.mesh) or "one rank"


def world_of(cfg: RunConfig, world: Optional[int] = None) -> int:
    return int(world or cfg.launch.num_processes)


def layout(cfg: RunConfig, world: Optional[int] = None, shard_the_rest: bool = False) -> Layout:
    """The layout a run config asks for on `world` ranks. The rest
    of the world (world / the axes given) is data parallel: sharded when `shard_the_rest` (the
    strategy shards parameters and dp_shard_size is left empty), replicated otherwise. The
    data-parallel degree is the same either way."""
    world = world_of(cfg, world)
    p = cfg.parallel
    tp, cp, sp, pp = p.tp_size, p.cp_size, p.sp_size, p.pp_size
    replicate, shard = p.dp_replicate_size, p.dp_shard_size
    rest = max(world // max(pp * tp * cp * sp * replicate, 1), 1)
    if not shard_the_rest and shard is None:
        return Layout(dp_replicate=replicate * rest, dp_shard=1, tp=tp, cp=cp, sp=sp, pp=pp)
    return Layout(dp_replicate=replicate, dp_shard=int(shard) if shard is not None else rest, tp=tp, cp=cp, sp=sp,
                  pp=pp)
