"""Pipeline parallel, the layout's fifth axis: the rules by key, the split of decoder layers
into stages, and the bubble of each schedule. Pure: imports neither torch nor Transformers
(training/step/pipeline.py runs torch.distributed.pipelining on what this module decides).

    stage_count(cfg)            pp_size x stages per rank
    layer_split(8, 4)           [(0, 2), (2, 4), (4, 6), (6, 8)]: decoder layers per stage
    splits_that_work(4, 8)      the (pp_size, stages per rank) that divide 4 layers on 8 ranks
    bubble_fraction(cfg)        the share of a step a stage waits, (pp-1)/(v*m + pp-1)

A stage holds a whole number of decoder layers, the same number on every stage (torchtitan's
even split); the embedding goes with the first stage, the final norm and head with the last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from overdrive.errors import Problem
from overdrive.strategies.registry import of

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig


@dataclass(frozen=True)
class Schedule:
    torch_name: str  # torch.distributed.pipelining.schedules.get_schedule_class's name
    multi: bool  # several stages per rank (PipelineScheduleMulti)
    v_shape: bool = False  # rank r holds stages r and 2 pp - 1 - r (exactly two per rank)


SCHEDULES = {
    "gpipe": Schedule("GPipe", multi=False),
    "1f1b": Schedule("1F1B", multi=False),
    "interleaved_1f1b": Schedule("Interleaved1F1B", multi=True),
    "looped_bfs": Schedule("LoopedBFS", multi=True),
    "interleaved_zero_bubble": Schedule("InterleavedZeroBubble", multi=True),
    "zbv_zero_bubble": Schedule("ZBVZeroBubble", multi=True, v_shape=True),
    "dual_pipe_v": Schedule("DualPipeV", multi=True, v_shape=True),
}


def pp_size(cfg: RunConfig) -> int:
    return cfg.parallel.pp_size


def schedule(cfg: RunConfig) -> Schedule:
    return SCHEDULES[cfg.parallel.pp_schedule]


def stages_per_rank(cfg: RunConfig) -> int:
    given = cfg.parallel.pp_stages_per_rank
    return given if given is not None else (2 if schedule(cfg).multi else 1)


def stage_count(cfg: RunConfig) -> int:
    return pp_size(cfg) * stages_per_rank(cfg)


def microbatches(cfg: RunConfig) -> int:
    """pp_microbatches, or else the step's micro-batches when there are at least pp_size of
    them, else one sample per microbatch (the smallest bubble the step's samples allow)."""
    given = cfg.parallel.pp_microbatches
    if given is not None:
        return given
    accumulation, micro = cfg.training.gradient_accumulation_steps, cfg.training.micro_batch_size
    if accumulation >= pp_size(cfg) or micro == "auto":
        return accumulation
    return accumulation * micro


def stages_of_rank(pp_rank: int, pp: int, per_rank: int, v_shape: bool) -> list[int]:
    """The stage indices a pipeline rank holds: looped (r, r + pp, ...) or V-shaped (r, 2 pp - 1 - r)."""
    if v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def layer_split(layers: int, stages: int) -> list[tuple[int, int]]:
    """The [start, end) decoder layers of each stage: `layers` must divide by `stages`."""
    each = layers // stages
    return [(k * each, (k + 1) * each) for k in range(stages)]


def splits_that_work(layers: int, world: int) -> list[str]:
    """pp_size (x stages per rank) that divide `layers` evenly and `world` ranks."""
    found = []
    for pp in range(2, world + 1):
        if world % pp:
            continue
        for per_rank in (1, 2, 4):
            if layers % (pp * per_rank) == 0:
                found.append(f"pp_size={pp}" + (f" x {per_rank} stages per rank" if per_rank > 1 else ""))
    return found


def bubble_fraction(pp: int, microbatches_: int, per_rank: int = 1) -> float:
    """The share of a step each stage waits in GPipe/1F1B, (pp-1)/(m+pp-1); with v stages per
    rank (interleaved) the warm-up and drain shrink by v: (pp-1)/(v m + pp-1). The zero-bubble
    schedules fill part of it with weight-gradient work (this is their upper bound)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (per_rank * microbatches_ + pp - 1)


def problems(cfg: RunConfig, world: int, samples_per_replica: Optional[int]) -> list[Problem]:
    """The pipeline's rules, named by key (none when pp_size is 1). `samples_per_replica` is
    micro x accumulation (None while the micro-batch is `auto`)."""
    pp = pp_size(cfg)
    if pp == 1:
        return []
    found: list[Problem] = []
    sched, name = schedule(cfg), cfg.parallel.pp_schedule
    per_rank, m = stages_per_rank(cfg), microbatches(cfg)
    if not sched.multi and per_rank != 1:
        found.append(Problem("parallel.pp_stages_per_rank", f"{name} runs one stage per rank (it is {per_rank})",
                             fix="set parallel.pp_schedule=interleaved_1f1b for several stages per rank, or leave "
                             "parallel.pp_stages_per_rank empty"))
    if sched.multi and per_rank < 2:
        found.append(Problem("parallel.pp_stages_per_rank", f"{name} runs several stages per rank (it is {per_rank})",
                             fix="set parallel.pp_stages_per_rank=2 (or more), or parallel.pp_schedule=1f1b"))
    if sched.v_shape and per_rank != 2:
        found.append(Problem("parallel.pp_stages_per_rank", f"{name} runs exactly 2 stages per rank (a V)",
                             fix="set parallel.pp_stages_per_rank=2, or leave parallel.pp_stages_per_rank empty"))
    if name in ("1f1b", "dual_pipe_v") and m < pp:
        found.append(Problem("parallel.pp_microbatches", f"{name} needs at least as many microbatches as stages: "
                             f"{m} < pp_size {pp}", fix=f"set parallel.pp_microbatches >= {pp} (or raise "
                             "training.gradient_accumulation_steps)"))
    if sched.multi and not sched.v_shape and m % max(1, m // pp):
        found.append(Problem("parallel.pp_microbatches", f"{name} needs microbatches in whole rounds of pp_size {pp} "
                             f"(it is {m})", fix=f"make it a multiple of {pp}"))
    if samples_per_replica is not None and samples_per_replica % m:
        found.append(Problem("parallel.pp_microbatches", f"the {samples_per_replica} samples a replica takes per step "
                             f"(micro_batch_size x gradient_accumulation_steps) do not split into {m} microbatches",
                             fix=f"choose a pp_microbatches that divides {samples_per_replica}"))
    for axis, size in (("cp_size", cfg.parallel.cp_size), ("sp_size", cfg.parallel.sp_size)):
        if size > 1:
            found.append(Problem(f"parallel.{axis}", "pipeline stages are composed with tensor parallel and data "
                                 "parallel replicas, not with context or sequence parallel",
                                 fix=f"set parallel.{axis}=1 with parallel.pp_size > 1"))
    strategy = of(cfg).name
    if strategy == "deepspeed":
        found.append(Problem("parallel.strategy", "DeepSpeed's engine wraps the whole model, which a stage does not "
                             "hold (its own PipelineModule is not run here)",
                             fix="set parallel.strategy=ddp or fsdp with parallel.pp_size > 1"))
    if strategy == "fsdp" and cfg.parallel.fsdp.version != 2:
        found.append(Problem("parallel.fsdp.version", "pipeline stages are sharded by FSDP2 (fully_shard)",
                             fix="set parallel.fsdp.version=2"))
    if strategy == "fsdp" and cfg.parallel.dp_replicate_size > 1:
        found.append(Problem("parallel.dp_replicate_size", "pipeline stages are sharded over one data-parallel axis "
                             "(HSDP beside stages is not composed here)", fix="set parallel.dp_replicate_size=1"))
    if cfg.training.micro_batch_size == "auto":
        found.append(Problem("training.micro_batch_size", "`auto` probes the whole model on one device; a pipeline "
                             "stage holds a part of it", fix="set an integer micro_batch_size with parallel.pp_size > 1"))
    if cfg.precision.mixed_precision == "fp16":
        found.append(Problem("precision.mixed_precision", "fp16 needs a loss scaler across the pipeline's stages, "
                             "which is not run here", fix="use bf16 (or no) with parallel.pp_size > 1"))
    if cfg.compile.backend:
        found.append(Problem("compile.backend", "torch.compile of pipeline stages is not run here",
                             fix="leave compile.backend empty with parallel.pp_size > 1"))
    return found


def model_problems(cfg: RunConfig, hf_config: Any) -> list[Problem]:
    """The model's decoder layers against the stages asked for (no weights needed)."""
    if pp_size(cfg) == 1:
        return []
    layers = getattr(hf_config, "num_hidden_layers", None) or getattr(hf_config, "n_layer", None)
    stages, found = stage_count(cfg), []
    world = cfg.launch.num_processes
    if not layers:
        return [Problem("parallel.pp_size", f"{type(hf_config).__name__} does not say how many decoder layers it has",
                        fix="set parallel.pp_size=1")]
    if layers < stages or layers % stages:
        working = splits_that_work(int(layers), world)
        found.append(Problem("parallel.pp_size", f"the model's {layers} decoder layers do not split evenly into "
                             f"{stages} stages (pp_size {pp_size(cfg)} x {stages_per_rank(cfg)} per rank)"
                             + ("; a stage would be empty" if layers < stages else ""),
                             fix="splits that work on this world: " + (", ".join(working) or "none but pp_size=1")))
    if getattr(hf_config, "tie_word_embeddings", False):
        found.append(Problem("parallel.pp_size", "the model ties its embedding to its head, which sit on the first "
                             "and the last stage", fix="set model.architecture.tie_word_embeddings=false"))
    return found
