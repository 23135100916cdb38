"""The N-D layout: how the world splits into data-parallel replicas and shards, tensor,
context and sequence parallel groups (Accelerate's ParallelismConfig, after torchtitan's
ParallelDims). The sizes are worked out in config/mesh.py (the batch split needs them below
strategies/); this module adds the strategy's say in them, their rules and Accelerate's objects.

    lay = layout(cfg)                  # Layout(dp_replicate=2, dp_shard=2, tp=1, cp=1, sp=1)
    lay.data_parallel                  # dp_replicate x dp_shard: config/batch.py's data-parallel degree
    lay.mesh                           # (("dp_replicate", 2), ("dp_shard", 2)): Accelerate's mesh
    problems(cfg)                      # every rule, named by key

Which axis needs which strategy follows Accelerate 1.15 (parallelism_config.py, state.py):
HSDP, FSDP x TP and CP need FSDP2; SP is DeepSpeed's (Ulysses/ALST); TP composes with FSDP2
or, with no data-parallel replicas beside it, runs alone. Pure: imports neither torch nor
accelerate (`parallelism_config` builds Accelerate's object, importing it there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from overdrive.errors import Problem
from overdrive.config import mesh
from overdrive.config.mesh import KEYS, MESH_ORDER, Layout  # noqa: F401  (asked for here by the rest)
from overdrive.strategies import pipeline
from overdrive.strategies.registry import of

if TYPE_CHECKING:
    from overdrive.config.schema import RunConfig

def layout(cfg: RunConfig, world: Optional[int] = None) -> Layout:
    """The layout a run config asks for on `world` ranks (config/mesh.py's arithmetic): the rest
    of the world is sharded under a strategy that shards parameters, replicated under ddp."""
    return mesh.layout(cfg, world, shard_the_rest=of(cfg).name != "ddp")


def _world(cfg: RunConfig, world: Optional[int]) -> int:
    return mesh.world_of(cfg, world)


def summary(cfg: RunConfig, world: Optional[int] = None) -> dict[str, Any]:
    """The mesh (names, sizes) and the batch split's data-parallel degree, for explain and plan."""
    from overdrive.config.batch import data_parallel_degree  # the batch split's one answer

    world = _world(cfg, world)
    lay, degree = layout(cfg, world), data_parallel_degree(cfg)
    whose, pp = ("the pipeline's", f"pp {lay.pp} x ") if lay.pp > 1 else ("Accelerate's", "")
    text = (f"mesh {lay.describe()} ({whose} device mesh, outermost first); data-parallel degree "
            f"{world} / ({pp}tp {lay.tp} x cp {lay.cp} x sp {lay.sp}) = {degree}")
    return {"mesh": [list(axis) for axis in lay.mesh], "data_parallel": degree,
            "model_parallel": lay.model_parallel, "text": text}


def problems(cfg: RunConfig, world: Optional[int] = None) -> list[Problem]:
    """Every rule of the layout, named by key: the sizes against the world, the strategy each
    axis needs, the sequence length CP and SP split. (The model's heads and its tensor-parallel
    plan: `model_problems`.)"""
    world = _world(cfg, world)
    lay, strategy, found = layout(cfg, world), of(cfg).name, []
    p = cfg.parallel
    given = p.dp_replicate_size * lay.model_parallel  # the axes set; the rest of the world is data parallel
    if p.dp_shard_size is not None and lay.world != world:
        pp = f" x pp {lay.pp}" if lay.pp > 1 else ""
        found.append(Problem("parallel.dp_shard_size", f"dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} x tp "
                             f"{lay.tp} x cp {lay.cp} x sp {lay.sp}{pp} = {lay.world}, but there are {world} processes",
                             fix="make the sizes multiply to launch.num_processes, or leave parallel.dp_shard_size "
                                 "empty to give it the rest"))
    elif world % given:
        key = next((KEYS[n] for n in ("pp", "tp", "cp", "sp", "dp_replicate") if getattr(lay, n) > 1), "parallel.tp_size")
        found.append(Problem(key, f"dp_replicate x pp x tp x cp x sp = {given} does not divide {world} processes",
                             fix=f"make launch.num_processes a multiple of {given}"))
    if strategy == "ddp" and p.dp_shard_size not in (None, 1):
        found.append(Problem("parallel.dp_shard_size", "shards the model, which needs parallel.strategy=fsdp (it is ddp)",
                             fix="set parallel.strategy=fsdp, or remove parallel.dp_shard_size"))
    if strategy != "fsdp" and lay.cp > 1:
        found.append(Problem("parallel.cp_size", f"context parallel needs parallel.strategy=fsdp (FSDP2), as "
                             f"Accelerate rules; it is {strategy}", fix="set parallel.strategy=fsdp"))
    if strategy == "ddp" and lay.tp > 1 and lay.dp_replicate > 1 and lay.pp == 1:
        found.append(Problem("parallel.tp_size", f"tensor parallel beside {lay.dp_replicate} plain data-parallel replicas "
                             "(DDP x TP) is not composed by Accelerate", fix="set parallel.strategy=fsdp (FSDP2 x TP), or "
                             f"launch.num_processes={lay.tp} for tensor parallel alone"))
    if strategy == "deepspeed" and lay.tp > 1:
        # DeepSpeed's own AutoTP is configured in its JSON, not through ParallelismConfig.
        found.append(Problem("parallel.tp_size", "is not composed with DeepSpeed by Accelerate's ParallelismConfig "
                             "(DeepSpeed takes only sp_size)", fix="set parallel.strategy=fsdp"))
    if strategy == "fsdp":
        if p.fsdp.version != 2 and lay.is_nd:
            found.append(Problem("parallel.fsdp.version", f"the layout {lay.describe()} needs FSDP2",
                                 fix="set parallel.fsdp.version=2"))
        if lay.dp_replicate > 1 and lay.dp_shard == 1:
            found.append(Problem("parallel.dp_replicate_size", "replicas without shards are plain data parallel",
                                 fix="set parallel.strategy=ddp, or parallel.dp_shard_size > 1 for HSDP"))
        elif lay.tp > 1 and lay.cp == 1 and lay.pp == 1 and world == given and p.dp_shard_size in (None, 1):
            # Accelerate raises inside prepare: "FSDP is enabled but the parallelism config has no dimension
            # for FSDP to shard across".
            found.append(Problem("parallel.tp_size", f"every one of the {world} processes is in the tensor-parallel "
                                 "group, so FSDP2 has no ranks left to shard over", fix=f"set parallel.strategy=ddp "
                                 f"for tensor parallel alone, or launch.num_processes={2 * world} (FSDP2 x TP)"))
    if lay.sp > 1 and strategy != "deepspeed":
        found.append(Problem("parallel.sp_size", f"sequence parallel (Ulysses/ALST) needs parallel.strategy=deepspeed, "
                             f"as Accelerate rules; it is {strategy}",
                             fix="set parallel.strategy=deepspeed, or use parallel.cp_size with fsdp"))
    if lay.cp > 1 and lay.sp > 1:
        found.append(Problem("parallel.sp_size", "context and sequence parallel are mutually exclusive (Accelerate)",
                             fix="set parallel.cp_size=1 or parallel.sp_size=1"))
    seq = cfg.data.max_length
    if lay.cp > 1 and seq % (2 * lay.cp):
        found.append(Problem("data.max_length", f"{seq} does not divide into 2 x cp_size = {2 * lay.cp} chunks (torch's "
                             "load-balanced ring attention gives each rank two)",
                             fix=f"make data.max_length a multiple of {2 * lay.cp}"))
    if lay.sp > 1 and seq % lay.sp:
        found.append(Problem("data.max_length", f"{seq} does not divide by parallel.sp_size {lay.sp}",
                             fix=f"make data.max_length a multiple of {lay.sp}"))
    fixed = p.sp_seq_length
    if lay.sp > 1 and fixed is not None and fixed % lay.sp:
        found.append(Problem("parallel.sp_seq_length", f"{fixed} does not divide by parallel.sp_size {lay.sp}",
                             fix=f"make it a multiple of {lay.sp}"))
    micro = cfg.training.micro_batch_size
    samples = None if micro == "auto" else micro * cfg.training.gradient_accumulation_steps
    from overdrive.strategies import expert_parallel

    return found + pipeline.problems(cfg, world, samples) + expert_parallel.problems(cfg, world)


def loop_problems(cfg: RunConfig) -> list[Problem]:
    """What overdrive's own training loop does not do with this layout (a user's script run by
    `overdrive launch` may: Transformers' Trainer and TRL drive DeepSpeed's Ulysses themselves).
    Sequence parallel needs the loop to take its batches through DeepSpeed's Ulysses data-loader
    adapter (each rank a slice of every sequence, with `shift_labels`) and to average the loss
    over the slices by tokens; the loop computes `model(**batch).loss` on whole sequences."""
    if layout(cfg).sp == 1:
        return []
    return [Problem("parallel.sp_size", "overdrive's training loop does not split sequences for DeepSpeed's Ulysses "
                    "(its data-loader adapter and the loss over sequence slices)",
                    fix="run a Transformers Trainer / TRL script with `overdrive launch` (they drive Ulysses), "
                        "or use parallel.cp_size with fsdp")]


def model_problems(cfg: RunConfig, hf_config: Any) -> list[Problem]:
    """What the model's shape says about the layout: heads and KV heads divisible by tp (and
    heads by sp: Ulysses splits attention by head), and a tensor-parallel plan for tp > 1.
    `hf_config` is the Transformers config the run builds (no weights). The decoder layers
    against the pipeline stages: strategies/pipeline.py."""
    lay, found = layout(cfg), []
    heads = getattr(hf_config, "num_attention_heads", None) or getattr(hf_config, "n_head", None)
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if lay.tp > 1:
        if getattr(hf_config, "base_model_tp_plan", None) is None:
            found.append(Problem("parallel.tp_size", f"{type(hf_config).__name__} has no tensor-parallel plan "
                                 "(Transformers' base_model_tp_plan), so its layers cannot be split",
                                 fix="set parallel.tp_size=1, or use a model whose config has a tp plan (llama, "
                                     "mistral, qwen2, ...)"))
        for name, count in (("attention heads", heads), ("KV heads", kv)):
            if count and count % lay.tp:
                found.append(Problem("parallel.tp_size", f"the model's {count} {name} do not divide by {lay.tp}",
                                     fix=f"choose a tp_size that divides {count}"))
    if lay.sp > 1 and heads and heads % lay.sp:
        found.append(Problem("parallel.sp_size", f"the model's {heads} attention heads do not divide by {lay.sp}",
                             fix=f"choose an sp_size that divides {heads}"))
    from overdrive.strategies import expert_parallel

    return found + pipeline.model_problems(cfg, hf_config) + expert_parallel.model_problems(cfg, hf_config)


def parallelism_kwargs(cfg: RunConfig, world: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The arguments of Accelerate's ParallelismConfig for this run, or None when the run has
    only one data-parallel axis (plain DDP, FSDP, ZeRO: no mesh needed)."""
    lay = layout(cfg, world)
    if not lay.is_nd:
        return None
    p = cfg.parallel
    kwargs: dict[str, Any] = {"dp_replicate_size": lay.dp_replicate, "dp_shard_size": lay.dp_shard,
                              "tp_size": lay.tp, "cp_size": lay.cp, "sp_size": lay.sp}
    if lay.cp > 1:
        kwargs["cp_backend"] = "torch"
        kwargs["cp_handler"] = {"cp_comm_strategy": p.cp_comm_strategy}
    if lay.sp > 1:
        kwargs["sp_backend"] = "deepspeed"
        # DeepSpeed's batch (train_batch_size) counts dp_replicate x dp_shard as its data-parallel world.
        kwargs["dp_shard_size"] = lay.dp_shard * lay.dp_replicate
        kwargs["dp_replicate_size"] = 1
        kwargs["sp_handler"] = {"sp_seq_length": p.sp_seq_length or cfg.data.max_length,
                                "sp_seq_length_is_variable": p.sp_seq_length_is_variable,
                                "sp_attn_implementation": p.sp_attn_implementation}
    return kwargs


def parallelism_config(cfg: RunConfig, world: Optional[int] = None):
    """Accelerate's ParallelismConfig for this run (None without an N-D layout), every field
    given so nothing is read from PARALLELISM_CONFIG_* variables behind the config's back."""
    kwargs = parallelism_kwargs(cfg, world)
    if kwargs is None:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig, TorchContextParallelConfig

    if "cp_handler" in kwargs:
        kwargs["cp_handler"] = TorchContextParallelConfig(**kwargs["cp_handler"])
    if "sp_handler" in kwargs:
        kwargs["sp_handler"] = DeepSpeedSequenceParallelConfig(**kwargs["sp_handler"])
    return ParallelismConfig(**kwargs)
